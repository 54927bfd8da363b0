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
    """up.sh tags the image "<appVersion>-cpu", which is what values-kind.yaml resolves to."""
    text = (KIND / "up.sh").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("APP_VERSION="))
    script = f'ROOT="{REPO}"\n{line}\necho "$APP_VERSION"'
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30).stdout.strip()
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert got == app_version
    assert "--build-arg VARIANT=cpu" in text and "kind load docker-image" in text
    assert "values-kind.yaml" in text and "--wait" in text
    kind_values = yaml.safe_load((REPO / "deploy" / "helm" / "values-kind.yaml").read_text())
    assert kind_values["image"]["variant"] == "cpu" and kind_values["image"]["pullPolicy"] == "Never"


def test_make_kind_test_target_runs_the_script() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "kind-test:" in makefile and "deploy/kind/kind-test.sh" in makefile
    assert "PDSERVE_E2E_TARGETS=kind" in (KIND / "kind-test.sh").read_text()
