"""e2e fixtures: `target` runs the whole suite once per lane (`up`, `kind`); `reference` is the
single-engine answer (`pdserve generate --json`) on the very checkpoint the lanes serve.

Lanes come from PDSERVE_E2E_TARGETS (default "up": `make test`; `make kind-test` sets "kind"). The kind
lane fails with the reason when docker / kind / kubectl / helm are not usable (kind-test.sh checks first and
says why it does not start); test_kind.py, what only a Kubernetes deployment shows, is collected only there.
``own_target`` is for a test that breaks its deployment (tests run in random order, so none may
leave the shared one smaller than it found it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_targets import UpTarget, write_tiny_model  # noqa: E402
from kind_target import KindTarget, kind_unusable_reason  # noqa: E402

LANES = [lane.strip() for lane in os.environ.get("PDSERVE_E2E_TARGETS", "up").split(",") if lane.strip()]
if "kind" not in LANES:
    collect_ignore = ["test_kind.py"]
_MARKS = {"up": [pytest.mark.slow], "kind": [pytest.mark.kind]}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """test_kind.py runs in the kind lane only (not against `pdserve up` with PDSERVE_E2E_TARGETS=up,kind)."""
    other = [i for i in items if i.path.name == "test_kind.py"
             and getattr(i, "callspec", None) and i.callspec.params.get("target") != "kind"]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [i for i in items if i not in other]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "tiny")


@pytest.fixture(scope="session", params=[pytest.param(lane, marks=_MARKS.get(lane, [])) for lane in LANES])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    lane = request.param
    workdir = tmp_path_factory.mktemp(f"e2e-{lane}")
    if lane == "kind":
        reason = kind_unusable_reason()
        if reason:
            pytest.fail(f"the kind lane cannot run here: {reason} (see docs/deploy.md#kind)")
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
