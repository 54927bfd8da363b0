"""The chart's SLO planner (``planner.enabled``): its RBAC is exactly the Role intended, the pools' HPAs and
replicas give way to it (the router's do not), its container runs a ``pdserve planner run`` command line
the CLI accepts with the values' knobs, bad values are refused at render, and its objects match the
Kubernetes schemas. tests/integration/test_planner_k8s.py applies the same rendered RBAC to a real API
server and acts as the planner's ServiceAccount.

Golden: golden/planner.yaml is the planner's own templates (planner.yaml, planner-rbac.yaml) rendered with
every branch on (NetworkPolicies, a profile ConfigMap); the rest of a release is in the presets' goldens.
After an intended change, regenerate and review the diff:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/deploy/test_chart_planner.py -k golden
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from chart_helpers import (
    CHART,
    NAMESPACE,
    RELEASE,
    by_kind,
    component,
    deployment,
    render,
    render_fails,
    run_helm,
)
from test_chart_render import validate_all

GOLDEN = Path(__file__).resolve().parent / "golden" / "planner.yaml"
ON = ("planner.enabled=true",)
EVERY_BRANCH = (*ON, "networkPolicy.enabled=true", "planner.profile.configMap=pdserve-sweep",
                "planner.extraArgs[0]=--half-life", "planner.extraArgs[1]=120")
PLANNER = f"{RELEASE}-planner"

# (apiGroup, resource, verbs, resourceNames or None): every rule of the planner's Role, nothing else.
EXPECTED_RULES = {
    ("apps", "deployments/scale", ("get", "patch", "update"), (f"{RELEASE}-prefill", f"{RELEASE}-decode")),
    ("apps", "deployments", ("get",), (f"{RELEASE}-prefill", f"{RELEASE}-decode")),
    ("", "endpoints", ("get",), (f"{RELEASE}-router", f"{RELEASE}-prefill", f"{RELEASE}-decode")),
    ("coordination.k8s.io", "leases", ("get", "update"), (PLANNER,)),
    ("coordination.k8s.io", "leases", ("create",), None),  # create cannot be limited by name
}


def planner_text(sets: tuple[str, ...] = EVERY_BRANCH) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-s", "templates/planner-rbac.yaml",
            "-s", "templates/planner.yaml"]
    for s in sets:
        args += ["--set", s]
    return run_helm(*args).stdout


def role_rules(role: dict) -> set[tuple]:
    out = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, rule  # no nonResourceURLs
        names = tuple(rule["resourceNames"]) if "resourceNames" in rule else None
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.add((group, res, tuple(rule["verbs"]), names))
    return out


def planner_container(docs: list[dict]) -> dict:
    (c,) = deployment(docs, "planner")["spec"]["template"]["spec"]["containers"]
    return c


def test_golden_planner_render() -> None:
    text = planner_text()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert GOLDEN.is_file(), f"missing golden {GOLDEN}; create it with UPDATE_GOLDEN=1 (module docstring)"
    if text != GOLDEN.read_text():
        import difflib

        diff = "".join(difflib.unified_diff(GOLDEN.read_text().splitlines(True), text.splitlines(True),
                                            "golden/planner.yaml", "rendered", n=2))
        pytest.fail(f"the planner's render differs from its golden; if intended, regenerate with "
                    f"UPDATE_GOLDEN=1 and review:\n{diff[:6000]}")


def test_off_by_default_renders_nothing_of_the_planner() -> None:
    docs = render("default", ("networkPolicy.enabled=true",))
    assert not [d for d in docs if "planner" in d["metadata"]["name"]]
    assert all("replicas" in deployment(docs, role)["spec"] for role in ("prefill", "decode"))


def test_rbac_is_exactly_the_planners_role() -> None:
    docs = render("default", ON)
    roles = {r["metadata"]["name"]: r for r in by_kind(docs, "Role")}
    assert set(roles) == {PLANNER, f"{RELEASE}-router-discovery"}  # the router's Role is untouched
    assert role_rules(roles[PLANNER]) == EXPECTED_RULES
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    (binding,) = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] == PLANNER]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": PLANNER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": PLANNER, "namespace": NAMESPACE}]
    (sa,) = [s for s in by_kind(docs, "ServiceAccount") if s["metadata"]["name"] == PLANNER]
    assert sa["automountServiceAccountToken"] is False  # mounted by the planner's pod alone
    spec = deployment(docs, "planner")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == PLANNER and spec["automountServiceAccountToken"] is True
    for role in ("prefill", "decode"):  # workers still never talk to the API
        assert deployment(docs, role)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_the_pools_hpas_and_replicas_give_way_the_routers_do_not() -> None:
    hpas = ("prefill.autoscaling.enabled=true", "decode.autoscaling.enabled=true",
            "router.autoscaling.enabled=true", "redis.mode=bundled", "redis.auth.password=x")
    without = render("default", hpas)
    assert {component(h) for h in by_kind(without, "HorizontalPodAutoscaler")} == {"router", "prefill",
                                                                                   "decode"}
    docs = render("default", (*hpas, *ON))
    assert [component(h) for h in by_kind(docs, "HorizontalPodAutoscaler")] == ["router"]
    plain = render("default", (*ON, "prefill.replicas=3", "router.replicas=2", "redis.mode=bundled",
                               "redis.auth.password=x"))
    assert "replicas" not in deployment(plain, "prefill")["spec"]  # a helm upgrade never resets the planner's
    assert "replicas" not in deployment(plain, "decode")["spec"]
    assert deployment(plain, "router")["spec"]["replicas"] == 2
    assert deployment(plain, "planner")["spec"]["replicas"] == 1
    assert not by_kind(plain, "HorizontalPodAutoscaler")


def test_its_command_line_is_one_the_cli_accepts_with_the_values_knobs() -> None:
    from pdserve.app.cli import build_parser
    from pdserve.app.commands.planner import _setup

    docs = render("default", (*ON, "planner.slo.ttftMs=500", "planner.decode.max=3", "planner.prefill.min=0",
                              "planner.cooldown.upSeconds=30", "planner.utilisation=1",
                              "planner.profile.configMap=sweep", "planner.extraArgs[0]=--half-life",
                              "planner.extraArgs[1]=90"))
    c = planner_container(docs)
    assert c["image"] == planner_container(render("default", ON))["image"] == \
        deployment(docs, "router")["spec"]["template"]["spec"]["containers"][0]["image"]
    args = build_parser().parse_args(c["args"])
    assert (args.command, args.planner_command, args.actuator) == ("planner", "run", "kubernetes")
    assert (args.namespace, args.release, args.lease) == (NAMESPACE, RELEASE, PLANNER)
    assert args.metrics_port == 9090 and args.scrape_port_name == "metrics" and not args.dry_run
    assert args.profile == "/etc/pdserve/planner/sweep.json" and args.half_life == 90
    args.profile = None  # the ConfigMap is not here
    config, _ = _setup(args)
    assert (config.ttft_s, config.tpot_s, config.min_prefill, config.max_decode) == (0.5, 0.025, 0, 3)
    assert (config.up_cooldown_s, config.down_cooldown_s, config.utilisation) == (30, 300, 1)
    assert (args.lease_duration, args.renew_deadline, args.retry_period) == (15, 10, 2)
    assert args.settle_timeout == 600
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 9090}
    volumes = deployment(docs, "planner")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "profile", "configMap": {"name": "sweep", "items": [{"key": "sweep.json",
                                                                          "path": "sweep.json"}]}} in volumes


@pytest.mark.parametrize("sets,needle", [
    (("metrics.enabled=false",), "metrics.enabled"),
    (("planner.prefill.min=5", "planner.prefill.max=2"), "planner.prefill"),
    (("planner.cooldown.upSeconds=600",), "upSeconds"),
    (("planner.leaderElection.renewDeadlineSeconds=20",), "leaderElection"),
    (("planner.leaderElection.leaseDurationSeconds=0",), "leaseDurationSeconds"),  # the schema
    (("planner.replica=2",), "replica"),  # unknown key
])
def test_bad_values_are_refused(sets: tuple[str, ...], needle: str) -> None:
    assert needle in render_fails("default", (*ON, *sets))


def test_network_policies_let_the_planner_scrape_and_reach_the_api() -> None:
    monitoring = "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring"
    docs = render("default", (*ON, "networkPolicy.enabled=true", monitoring))
    pols = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    own = pols[PLANNER]
    assert own["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "planner"
    scrape, api = own["egress"]
    assert scrape["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert scrape["to"][0]["podSelector"]["matchExpressions"][1]["values"] == ["router", "prefill", "decode"]
    assert api["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}]
    assert {p["port"] for p in api["ports"]} == {443, 6443}
    (admit,) = pols[f"{PLANNER}-scrape"]["ingress"]  # the pods' metrics admit the planner though metricsFrom
    assert admit["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "planner"
    assert admit["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert not by_kind(render("default", ON), "NetworkPolicy")


def test_planner_objects_match_kubernetes_schemas() -> None:
    docs = [d for d in yaml.safe_load_all(planner_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "NetworkPolicy"}
    validate_all(docs, "planner")
