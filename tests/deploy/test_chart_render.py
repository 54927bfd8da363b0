"""`helm lint`, `helm template`, offline Kubernetes schema validation and golden renders.

Golden renders live in tests/deploy/golden/<preset>.yaml (release "pdserve", namespace "pdserve").
After an intended chart change, regenerate them and review the diff:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/deploy/test_chart_render.py -k golden
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import kubernetes_validate
import pytest
from chart_helpers import CHART, VALUES, by_kind, render, render_text, run_helm

GOLDEN = Path(__file__).resolve().parent / "golden"
PRESETS = sorted(VALUES)
# Oldest supported (native gRPC probes GA) and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
# Custom resources: no upstream schema; checked structurally below.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
# kubernetes-validate re-reads and re-parses the multi-megabyte _definitions.json on every call; the
# schema files are read-only data, so parse each once (keeps this module's runtime to a few seconds).
kubernetes_validate.utils.schema_contents = functools.cache(kubernetes_validate.utils.schema_contents)


@pytest.mark.parametrize("preset", PRESETS)
def test_helm_lint(preset: str) -> None:
    args = ["lint", str(CHART), "--strict"]
    for f in VALUES[preset]:
        args += ["-f", str(f)]
    out = run_helm(*args).stdout
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("preset", PRESETS)
def test_rendered_manifests_match_kubernetes_schemas(preset: str) -> None:
    docs = render(preset)
    assert len(docs) >= 8
    checked = validate_all([d for d in docs if (d["apiVersion"], d["kind"]) not in CRDS], preset)
    assert checked >= len(K8S_VERSIONS) * 8


def validate_all(docs: list[dict], label: str) -> int:
    """Every document against every version's strict schema (kubernetes-validate, offline); a test failure
    names the first invalid one. Returns the validations made."""
    checked = 0
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{label}: {doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes "
                            f"{version} at {list(e.path)}: {e.message}")
            checked += 1
    return checked


def test_schema_validation_catches_a_bad_manifest() -> None:
    """Negative control: the validator really rejects a wrong field and an unknown field."""
    docs = render("default")
    dep = copy.deepcopy(by_kind(docs, "Deployment")[0])
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)
    dep = copy.deepcopy(by_kind(docs, "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)


def test_servicemonitor_shape() -> None:
    (sm,) = by_kind(render("gpu"), "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "pdserve"
    assert not by_kind(render("default"), "ServiceMonitor")


@pytest.mark.parametrize("preset", PRESETS)
def test_golden_render(preset: str) -> None:
    path = GOLDEN / f"{preset}.yaml"
    text = render_text(preset)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing golden {path}; create it with UPDATE_GOLDEN=1 (see module docstring)"
    expected = path.read_text()
    if text != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{preset}.yaml", "rendered", n=2))
        pytest.fail(f"render of preset {preset!r} differs from the golden file; if intended, regenerate with "
                    f"UPDATE_GOLDEN=1 and review:\n{diff[:6000]}")
