"""The chart follows what the cluster serves (templates/_cluster.tpl), rendered offline for two clusters:

* Kubernetes 1.20.2, with the exact list of group/versions and kinds the kind lane's cluster serves
  (api-versions/kubernetes-1.20.2.txt, read from it): PodDisruptionBudgets policy/v1beta1, HPAs
  autoscaling/v2beta2, probes as exec `pdserve-healthcheck` (no gRPC probes before 1.24), NetworkPolicy
  port ranges port by port (no endPort before 1.22), and nothing the server does not serve;
* a current release (the newest schemas kubernetes-validate ships): policy/v1, autoscaling/v2, native gRPC
  probes, every object valid against that release's schemas.

Plus the values switch for clusters without DNS (serviceAddresses=env) and the service variables it
brings into every pod, which must not shadow a PDSERVE_* setting.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import kubernetes_validate
import pytest
from chart_helpers import CHART, REPO, by_kind, component, run_helm

from pdserve.settings import ENV_PREFIX, ServeSettings

API_VERSIONS = Path(__file__).resolve().parent / "api-versions"
KIND_VALUES = REPO / "deploy" / "helm" / "values-kind.yaml"
LATEST = kubernetes_validate.utils.latest_version()
# What a current cluster serves of the kinds this chart renders (each at its one current version).
CURRENT = ["v1", "v1/Service", "v1/ServiceAccount", "v1/Secret", "v1/ConfigMap", "v1/Pod", "apps/v1",
           "apps/v1/Deployment", "apps/v1/StatefulSet", "policy/v1", "policy/v1/PodDisruptionBudget",
           "autoscaling/v2", "autoscaling/v2/HorizontalPodAutoscaler", "discovery.k8s.io/v1",
           "discovery.k8s.io/v1/EndpointSlice", "rbac.authorization.k8s.io/v1",
           "rbac.authorization.k8s.io/v1/Role", "rbac.authorization.k8s.io/v1/RoleBinding",
           "networking.k8s.io/v1", "networking.k8s.io/v1/NetworkPolicy"]
# Everything that has an API-version or probe choice turned on: HPAs, NetworkPolicies with a KV port range.
EVERYTHING = ("prefill.autoscaling.enabled=true", "decode.autoscaling.enabled=true",
              "router.autoscaling.enabled=true", "networkPolicy.enabled=true", "kvTransport.type=tcp",
              "engine.device=cuda", "decode.tensorParallelSize=2")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def served(version: str) -> list[str]:
    lines = (API_VERSIONS / f"kubernetes-{version}.txt").read_text().splitlines()
    return [ln for ln in lines if ln and not ln.startswith("#")]


def render_for(kube_version: str, api_versions: list[str], sets: tuple[str, ...] = EVERYTHING,
               check: bool = True):
    args = ["template", "pdserve", str(CHART), "--namespace", "pdserve", "-f", str(KIND_VALUES),
            "--kube-version", kube_version]
    for v in api_versions:
        args += ["--api-versions", v]
    for s in sets:
        args += ["--set", s]
    proc = run_helm(*args, check=check)
    if not check:
        return proc
    import yaml

    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def pdserve_containers(docs: list[dict]):
    for dep in by_kind(docs, "Deployment"):
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        yield component(dep), c


def test_kubernetes_1_20_render_uses_only_what_1_20_serves() -> None:
    api = served("1.20.2")
    docs = render_for("1.20.2", api)
    assert {(d["apiVersion"], d["kind"]) for d in docs} >= {("policy/v1beta1", "PodDisruptionBudget"),
                                                           ("autoscaling/v2beta2", "HorizontalPodAutoscaler")}
    unserved = sorted({f"{d['apiVersion']}/{d['kind']}" for d in docs} - set(api))
    assert unserved == [], f"not served by Kubernetes 1.20: {unserved}"
    for role, c in pdserve_containers(docs):
        for kind in PROBES:
            probe = c[kind]
            assert "grpc" not in probe, (role, kind)
            command = probe["exec"]["command"]
            assert command[:3] == ["pdserve-healthcheck", "--port", "50051"], (role, kind)
        service = c["readinessProbe"]["exec"]["command"][4]
        assert service == f"pdserve.v1.{role.title()}"
    for policy in by_kind(docs, "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
            assert all("endPort" not in p for p in rule.get("ports", [])), policy["metadata"]["name"]
    kv_ports = {p["port"] for pol in by_kind(docs, "NetworkPolicy") for r in pol["spec"].get("ingress", [])
                for p in r.get("ports", [])}
    assert {50052, 50053} <= kv_ports  # the TP-2 decode range, port by port


def test_current_kubernetes_render_uses_current_versions() -> None:
    docs = render_for(LATEST, CURRENT)
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    assert {("policy/v1", "PodDisruptionBudget"), ("autoscaling/v2", "HorizontalPodAutoscaler")} <= kinds
    assert not {v for v, _ in kinds} & {"policy/v1beta1", "autoscaling/v2beta2"}
    for role, c in pdserve_containers(docs):
        assert all(c[kind]["grpc"]["port"] == 50051 for kind in PROBES), role
    assert any("endPort" in p for pol in by_kind(docs, "NetworkPolicy")
               for r in pol["spec"].get("ingress", []) for p in r.get("ports", []))
    for doc in docs:
        kubernetes_validate.validate(doc, LATEST, strict=True)


def test_k8s_discovery_needs_a_served_endpointslice_version() -> None:
    no_slices = [v for v in served("1.20.2") if not v.startswith("discovery.k8s.io")]
    proc = render_for("1.20.2", no_slices, sets=(), check=False)
    assert proc.returncode != 0 and "serves neither" in proc.stderr
    assert render_for("1.20.2", no_slices, sets=("router.discovery=redis",))


def test_service_addresses_env_for_clusters_without_dns() -> None:
    dns = render_for(LATEST, CURRENT, sets=())
    env = render_for(LATEST, CURRENT, sets=("serviceAddresses=env",))
    for docs, links in ((dns, False), (env, True)):
        for role, _ in pdserve_containers(docs):
            dep = next(d for d in by_kind(docs, "Deployment") if component(d) == role)
            assert dep["spec"]["template"]["spec"]["enableServiceLinks"] is links, role
    router = dict(pdserve_containers(env))["router"]
    redis_url = next(e["value"] for e in router["env"] if e["name"] == "PDSERVE_REDIS")
    assert redis_url == "redis://:$(PDSERVE_REDIS_PASSWORD)@$(PDSERVE_REDIS_SERVICE_HOST):6379/0"
    (test_pod,) = by_kind(env, "Pod")
    assert "$(PDSERVE_ROUTER_SERVICE_HOST):50051" in test_pod["spec"]["containers"][0]["args"]
    assert test_pod["spec"]["enableServiceLinks"] is True
    dns_router = dict(pdserve_containers(dns))["router"]
    dns_url = next(e["value"] for e in dns_router["env"] if e["name"] == "PDSERVE_REDIS")
    assert dns_url.endswith("@pdserve-redis:6379/0")


def test_service_variables_do_not_shadow_settings() -> None:
    """With service links on, the kubelet sets <SERVICE>_SERVICE_HOST, _PORT... for every Service with a
    cluster IP; none of those may be a PDSERVE_* setting the pods read (settings.py)."""
    settings = {ENV_PREFIX + f.name.upper() for f in fields(ServeSettings)}
    docs = render_for(LATEST, CURRENT, sets=(*EVERYTHING, "serviceAddresses=env", "metrics.enabled=true"))
    injected = set()
    for svc in by_kind(docs, "Service"):
        if svc["spec"].get("clusterIP") == "None":
            continue
        name = svc["metadata"]["name"].upper().replace("-", "_")
        injected |= {f"{name}_SERVICE_HOST", f"{name}_SERVICE_PORT", f"{name}_PORT"}
        for p in svc["spec"]["ports"]:
            base = f"{name}_PORT_{p['port']}_{p.get('protocol', 'TCP')}"
            injected |= {f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}", base, f"{base}_PROTO",
                         f"{base}_PORT", f"{base}_ADDR"}
    assert len(injected) > 10
    assert injected & settings == set()


@pytest.mark.parametrize("sets", [(), ("kvTransport.type=tcp",)])
def test_offline_render_without_cluster_facts_keeps_current_forms(sets: tuple[str, ...]) -> None:
    """Plain `helm template` (no --api-versions: no served kinds listed) renders the current forms, whatever
    KubeVersion Helm assumes offline (v1.20.0 for Helm 3.6)."""
    proc = run_helm("template", "pdserve", str(CHART), *[a for s in sets for a in ("--set", s)])
    import yaml

    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert {d["apiVersion"] for d in by_kind(docs, "PodDisruptionBudget")} == {"policy/v1"}
    assert all("grpc" in c["readinessProbe"] for _, c in pdserve_containers(docs))
