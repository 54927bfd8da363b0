"""Container lane fixtures. The lane runs from `make container-test` (deploy/container/lane.sh), which
starts a Docker engine, builds the image and sets PDSERVE_CONTAINER_IMAGE; without that variable these
tests are not collected, so `make test` (which has its own `up` e2e lane) does not run them twice.

`target` runs every test of the module once per KV transport (PDSERVE_CONTAINER_TRANSPORTS, default
"nixl,tcp"): NIXL over UCX's TCP transport between containers (the chart's simulated RDMA) and plain TCP.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "e2e"))

IMAGE = os.environ.get("PDSERVE_CONTAINER_IMAGE", "")
if not IMAGE:
    collect_ignore_glob = ["test_*.py"]

from e2e_targets import write_tiny_model  # noqa: E402
from lane import TRANSPORTS, ContainerCluster, remove_lane  # noqa: E402

LANE_TRANSPORTS = [t.strip() for t in os.environ.get("PDSERVE_CONTAINER_TRANSPORTS", ",".join(TRANSPORTS))
                   .split(",") if t.strip()]


@pytest.fixture(scope="session")
def image() -> str:
    # What an interrupted earlier run left behind (everything the lane makes is labelled pdserve.lane;
    # one lane runs per Docker engine at a time).
    remove_lane("")
    return IMAGE


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint the chart's init container writes, made locally for the single-engine reference."""
    return write_tiny_model(tmp_path_factory.mktemp("container-model") / "tiny")


@pytest.fixture(scope="module", params=LANE_TRANSPORTS)
def target(request: pytest.FixtureRequest, image: str, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp(f"container-{request.param}")
    cluster = ContainerCluster(image=image, transport=request.param, workdir=workdir)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def own_target(target):
    """For a test that breaks its deployment: the shared cluster, as in the kind lane (before every test
    of the module, ``chart_replicas`` starts new containers for lost pods, as Kubernetes replaces them)."""
    return target
