"""e2e fixtures: `target` runs the whole suite once per lane (`up`, `kind`); `reference` is the
single-engine answer (`pdserve generate --json`) on the very checkpoint the lanes serve.

Lanes come from PDSERVE_E2E_TARGETS (default "up,kind"; `make kind-test` sets "kind"). The kind lane
skips, with the reason, when docker / kind / kubectl are not usable; the up lane never skips.
``own_target`` is for a test that breaks its deployment (tests run in random order, so none may
leave the shared one smaller than it found it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_targets import KindTarget, UpTarget, kind_unusable_reason, write_tiny_model  # noqa: E402

LANES = [lane.strip() for lane in os.environ.get("PDSERVE_E2E_TARGETS", "up,kind").split(",") if lane.strip()]
_MARKS = {"up": [pytest.mark.slow], "kind": [pytest.mark.kind]}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "tiny")


@pytest.fixture(scope="module", params=[pytest.param(lane, marks=_MARKS.get(lane, [])) for lane in LANES])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    lane = request.param
    workdir = tmp_path_factory.mktemp(f"e2e-{lane}")
    if lane == "kind":
        reason = kind_unusable_reason()
        if reason:
            pytest.skip(f"kind lane skipped: {reason}. It runs for real where Docker and kind work "
                        f"(`make kind-test`); the same tests run against `pdserve up` in the up lane.")
        t = KindTarget(workdir)
    elif lane == "up":
        t = UpTarget(workdir, request.getfixturevalue("tiny_model"))
    else:
        raise ValueError(f"unknown e2e lane {lane!r} in PDSERVE_E2E_TARGETS (use up, kind)")
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def own_target(target, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A deployment a test may break: a fresh `pdserve up` in the up lane (a killed process stays dead
    there); the lane's shared one in the kind lane, where Kubernetes replaces a deleted pod."""
    if target.name != "up":
        yield target
        return
    t = UpTarget(tmp_path_factory.mktemp("e2e-up-own"), request.getfixturevalue("tiny_model"))
    try:
        yield t
    finally:
        t.close()
