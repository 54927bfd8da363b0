"""Static checks of the kind tooling (the kind lane itself needs Docker; these run everywhere)."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from chart_helpers import CHART, REPO

KIND = REPO / "deploy" / "kind"
SCRIPTS = ["up.sh", "down.sh", "kind-test.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_are_executable(script: str) -> None:
    path = KIND / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "set -euo pipefail" in path.read_text()


def test_kind_cluster_config() -> None:
    cfg = yaml.safe_load((KIND / "kind-config.yaml").read_text())
    assert cfg["kind"] == "Cluster" and cfg["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    roles = [n["role"] for n in cfg["nodes"]]
    assert roles.count("control-plane") == 1 and roles.count("worker") >= 2


def test_up_script_builds_the_chart_appversion_cpu_image() -> None:
    """lib.sh names the image "<appVersion>-cpu" (what build-image.sh builds); up.sh loads it and installs
    values-kind.yaml with it, waiting for Ready."""
    env = subprocess.run(["bash", "-c", f'source "{KIND / "lib.sh"}" && echo "$IMAGE"'], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "IMAGE": ""}).stdout.strip()
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert env == f"pdserve:{app_version}-cpu"
    text = (KIND / "up.sh").read_text()
    assert "deploy/container/build-image.sh" in text and "kind load docker-image" in text
    assert "values-kind.yaml" in text and "--wait" in text and "serviceAddresses=env" in text
    kind_values = yaml.safe_load((REPO / "deploy" / "helm" / "values-kind.yaml").read_text())
    assert kind_values["image"]["variant"] == "cpu" and kind_values["image"]["pullPolicy"] == "Never"
    assert kind_values["redis"]["mode"] == "bundled"


def test_lane_uses_k8s_local_when_it_is_there(tmp_path) -> None:
    """A k8s-local directory (setup.sh's kind, kubectl, kubeconfig) makes the lane reuse its cluster `kp`;
    without one the lane makes its own from kind-config.yaml."""
    local = tmp_path / "k8s-local"
    (local / "kindpkg" / "usr" / "bin").mkdir(parents=True)
    (local / "kindpkg" / "usr" / "bin" / "kind").write_text("#!/bin/sh\n")
    (local / "kindpkg" / "usr" / "bin" / "kind").chmod(0o755)
    script = f'source "{KIND / "lib.sh"}" && echo "$KIND_CLUSTER $KIND_NODE_IMAGE $KUBECONFIG"'
    base = {k: v for k, v in os.environ.items() if k not in ("KIND_CLUSTER", "KIND_NODE_IMAGE", "KUBECONFIG")}
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**base, "K8S_LOCAL_DIR": str(local)}).stdout.split()
    assert got == ["kp", "kp/node:v1.20.2", str(local / "kubeconfig")]
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**base, "K8S_LOCAL_DIR": str(tmp_path / "none")}).stdout.split()
    assert got == ["pdserve-e2e"]


def test_lane_estimate_is_a_number_of_seconds() -> None:
    out = subprocess.run([str(KIND / "kind-test.sh"), "--estimate"], capture_output=True, text=True,
                         timeout=120).stdout.strip()
    assert out.isdigit() and int(out) > 0


def test_make_kind_test_target_runs_the_script() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "kind-test:" in makefile and "deploy/kind/kind-test.sh" in makefile
    assert "PDSERVE_E2E_TARGETS=kind" in (KIND / "kind-test.sh").read_text()


def test_lib_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(KIND / "lib.sh")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
