"""Properties the chart must keep whatever the values: per-pool replicas and resources, native gRPC
probes, drain inside the grace period, minimal RBAC, pinned images, resources on every container,
pool-local upgrades, transport wiring, NetworkPolicy paths, and the env contract with `pdserve serve`."""

from __future__ import annotations

import re

import pytest
from chart_helpers import (
    RELEASE,
    ROLES,
    VALUES,
    by_kind,
    component,
    deployment,
    pod_specs,
    render,
    render_fails,
)

PRESETS = sorted(VALUES)
SERVICE_NAMES = {"router": "pdserve.v1.Router", "prefill": "pdserve.v1.Prefill",
                 "decode": "pdserve.v1.Decode"}


def served_health_names(role: str) -> list[str]:
    """The grpc.health.v1 service names `pdserve serve --role ROLE` registers (the serving contract)."""
    from pdserve.app.roles import SERVICE_NAMES as SERVED

    return SERVED[role]


def container(docs: list[dict], role: str) -> dict:
    (c,) = deployment(docs, role)["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_pools_have_their_own_replicas_and_resources() -> None:
    docs = render("default", ("prefill.replicas=3", "decode.replicas=5", "router.replicas=1",
                              "prefill.resources.limits.cpu=7", "decode.resources.limits.memory=77Gi"))
    assert deployment(docs, "prefill")["spec"]["replicas"] == 3
    assert deployment(docs, "decode")["spec"]["replicas"] == 5
    assert deployment(docs, "router")["spec"]["replicas"] == 1
    assert container(docs, "prefill")["resources"]["limits"]["cpu"] == 7
    assert container(docs, "decode")["resources"]["limits"]["memory"] == "77Gi"
    assert container(docs, "decode")["resources"]["limits"]["cpu"] != 7
    kind = render("kind")
    assert deployment(kind, "prefill")["spec"]["replicas"] == 2
    assert deployment(kind, "decode")["spec"]["replicas"] == 2


def test_gpu_preset_places_pools_on_their_node_pools() -> None:
    docs = render("gpu")
    pre, dec = (deployment(docs, r)["spec"]["template"]["spec"] for r in ("prefill", "decode"))
    assert pre["nodeSelector"] != dec["nodeSelector"]
    assert pre["nodeSelector"]["node.kubernetes.io/pool"] == "gpu-compute"
    assert dec["nodeSelector"]["node.kubernetes.io/pool"] == "gpu-memory"
    for role in ("prefill", "decode"):
        res = container(docs, role)["resources"]
        assert res["limits"]["nvidia.com/gpu"] == 1
        assert res["limits"]["rdma/rdma_shared_device_a"] == 1
        assert res["requests"]["rdma/rdma_shared_device_a"] == 1
    assert "nvidia.com/gpu" not in container(docs, "router")["resources"]["limits"]


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "tls"])
def test_probes_are_native_grpc_health_checks(preset: str) -> None:
    docs = render(preset)
    for role in ROLES:
        c = container(docs, role)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert set(c[probe]) >= {"grpc", "periodSeconds", "failureThreshold"}, (role, probe)
            assert "exec" not in c[probe] and "httpGet" not in c[probe] and "tcpSocket" not in c[probe]
            assert c[probe]["grpc"]["port"] == 50051
        # readiness = the role's own service (SERVING only once model + KV transport are up)
        assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAMES[role]
        assert SERVICE_NAMES[role] in served_health_names(role)
        assert c["livenessProbe"]["grpc"]["service"] == ""


@pytest.mark.parametrize("preset", PRESETS)
def test_grace_period_exceeds_prestop_plus_drain(preset: str) -> None:
    docs = render(preset)
    for role in ROLES:
        spec = deployment(docs, role)["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = float(env_of(c)["PDSERVE_DRAIN_TIMEOUT"])
        assert sleep > 0 and drain > 0
        assert spec["terminationGracePeriodSeconds"] > sleep + drain, role


def test_chart_refuses_a_grace_period_shorter_than_the_drain() -> None:
    err = render_fails("default", ("drain.timeoutSeconds=60", "drain.terminationGracePeriodSeconds=40"))
    assert "terminationGracePeriodSeconds" in err


@pytest.mark.parametrize("preset", PRESETS)
def test_rbac_is_read_only_endpointslices_in_namespace(preset: str) -> None:
    docs = render(preset)
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    (role,) = by_kind(docs, "Role")
    allowed = {("discovery.k8s.io", "endpointslices")}  # what router/discovery/k8s.py lists/watches
    seen = set()
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                assert (group, res) in allowed, rule
                seen.add((group, res))
    assert seen == allowed
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] == role["metadata"]["name"]
    (sa,) = by_kind(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "pdserve"}]
    router_spec = deployment(docs, "router")["spec"]["template"]["spec"]
    assert router_spec["serviceAccountName"] == sa["metadata"]["name"]
    for role_name in ("prefill", "decode"):  # workers never talk to the API
        spec = deployment(docs, role_name)["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False


def test_no_rbac_without_k8s_discovery() -> None:
    docs = render("default", ("router.discovery=redis", "redis.mode=bundled", "redis.auth.password=x"))
    assert not by_kind(docs, "Role")
    assert deployment(docs, "router")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("preset", PRESETS)
def test_images_are_pinned_never_latest(preset: str) -> None:
    for name, spec in pod_specs(render(preset)):
        for c in spec.get("initContainers", []) + spec["containers"]:
            repo, _, tag = c["image"].rpartition(":")
            assert repo and "/" not in tag and tag, (name, c["image"])
            assert tag != "latest", (name, c["image"])
    assert container(render("default"), "decode")["image"].endswith(":0.1.0-cuda")  # appVersion-variant
    assert container(render("kind"), "decode")["image"] == "pdserve:0.1.0-cpu"
    assert "not" in render_fails("default", ("image.tag=latest",))


EVERYTHING_ON = ("redis.mode=bundled", "redis.auth.password=x", "router.replicas=2",
                 "networkPolicy.enabled=true", "metrics.serviceMonitor.enabled=true",
                 "prefill.autoscaling.enabled=true", "decode.autoscaling.enabled=true",
                 "router.autoscaling.enabled=true")


@pytest.mark.parametrize("case", [*PRESETS, "everything-on"])
def test_every_container_has_resources(case: str) -> None:
    docs = render("default", EVERYTHING_ON) if case == "everything-on" else render(case)
    seen = 0
    for name, spec in pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            res = c.get("resources") or {}
            assert res.get("requests") and res.get("limits"), (name, c["name"])
            assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
            seen += 1
    assert seen >= 5  # router, prefill, decode, test pod, + init containers / Redis where enabled


@pytest.mark.parametrize("pool,other", [("decode", "prefill"), ("prefill", "decode")])
def test_scaling_one_pool_rerenders_only_that_deployment(pool: str, other: str) -> None:
    """`helm upgrade --set <pool>.replicas=N` must leave every other object (above all the other pool's
    pod template) byte-identical, so the other pool is never restarted."""
    for preset in ("default", "kind"):
        base = render(preset)
        scaled = render(preset, (f"{pool}.replicas=7",))
        assert len(base) == len(scaled)
        changed = [(a["kind"], a["metadata"]["name"]) for a, b in zip(base, scaled, strict=True) if a != b]
        assert changed == [("Deployment", f"{RELEASE}-{pool}")], changed
        assert deployment(scaled, pool)["spec"]["replicas"] == 7
        assert deployment(scaled, other) == deployment(base, other)


def test_autoscaling_leaves_replicas_to_the_hpa() -> None:
    docs = render("default", ("decode.autoscaling.enabled=true", "decode.autoscaling.maxReplicas=6"))
    assert "replicas" not in deployment(docs, "decode")["spec"]
    assert deployment(docs, "prefill")["spec"]["replicas"] == 1
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": f"{RELEASE}-decode"}
    assert hpa["spec"]["maxReplicas"] == 6
    assert "maxReplicas" in render_fails("default", ("decode.autoscaling.enabled=true",
                                                     "decode.autoscaling.minReplicas=5",
                                                     "decode.autoscaling.maxReplicas=2"))


def test_pdbs_per_component() -> None:
    pdbs = {component(p): p for p in by_kind(render("default"), "PodDisruptionBudget")}
    assert set(pdbs) == set(ROLES)
    for role, pdb in pdbs.items():
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role


def test_worker_services_are_headless_router_is_not() -> None:
    services = {component(s): s for s in by_kind(render("default"), "Service")}
    assert services["prefill"]["spec"]["clusterIP"] == "None"
    assert services["decode"]["spec"]["clusterIP"] == "None"
    assert services["router"]["spec"].get("clusterIP") != "None"
    assert services["router"]["spec"]["ports"][0]["appProtocol"] == "grpc"


def test_kind_preset_is_simulated_rdma_without_devices() -> None:
    docs = render("kind")
    for role in ("prefill", "decode"):
        c = container(docs, role)
        env = env_of(c)
        assert env["PDSERVE_TRANSPORT"] == "nixl" and env["UCX_TLS"] == "tcp"
        assert "UCX_NET_DEVICES" not in env
        assert not [k for k in c["resources"]["limits"] if "rdma" in k or k == "nvidia.com/gpu"]
        assert "add" not in c["securityContext"]["capabilities"]
        assert env["PDSERVE_DEVICE"] == "cpu"


def test_gpu_preset_wires_rdma_ipc_lock_and_ucx() -> None:
    docs = render("gpu")
    for role in ("prefill", "decode"):
        c = container(docs, role)
        env = env_of(c)
        assert env["PDSERVE_TRANSPORT"] == "nixl"
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert "add" not in container(docs, "router")["securityContext"]["capabilities"]
    custom = render("gpu", ("kvTransport.rdma.resourceName=nvidia.com/hostdev", "kvTransport.rdma.count=2"))
    assert container(custom, "decode")["resources"]["limits"]["nvidia.com/hostdev"] == 2


def test_tcp_transport_has_no_ucx_env() -> None:
    env = env_of(container(render("default", ("kvTransport.type=tcp",)), "decode"))
    assert env["PDSERVE_TRANSPORT"] == "tcp" and not [k for k in env if k.startswith("UCX_")]


@pytest.mark.parametrize("source,sets,volume_key", [
    ("init", (), "emptyDir"),
    ("pvc", ("model.source=pvc", "model.pvc.claimName=weights", "model.subPath=llama"),
     "persistentVolumeClaim"),
    ("hostPath", ("model.source=hostPath", "model.hostPath.path=/mnt/models/llama"), "hostPath"),
])
def test_model_sources(source: str, sets: tuple[str, ...], volume_key: str) -> None:
    docs = render("default", sets)
    for role in ROLES:
        spec = deployment(docs, role)["spec"]["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "model"]
        assert volume_key in vol
        init = [c for c in spec.get("initContainers", []) if c["name"] == "model-init"]
        assert bool(init) == (source == "init")
        env = env_of(spec["containers"][0])
        if source == "init":
            assert init[0]["args"][:4] == ["model", "init", "--preset", "tiny"]
            out_dir = init[0]["args"][init[0]["args"].index("--out") + 1]
            assert env["PDSERVE_MODEL"] == out_dir == "/models/tiny"
        elif source == "pvc":
            assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
            assert env["PDSERVE_MODEL"] == "/models/llama"
        else:
            assert env["PDSERVE_MODEL"] == "/models"
    assert "claimName" in render_fails("default", ("model.source=pvc",))


@pytest.mark.parametrize("kind,sets,volume", [
    ("emptyDir", (), {"emptyDir": {"sizeLimit": "2Gi"}}),
    ("pvc", ("engine.kernelCache.type=pvc", "engine.kernelCache.claimName=kernels"),
     {"persistentVolumeClaim": {"claimName": "kernels"}}),
    ("hostPath", ("engine.kernelCache.type=hostPath",),
     {"hostPath": {"path": "/var/cache/pdserve-kernels", "type": "Directory"}}),
])
def test_workers_keep_compiled_kernels_where_asked(kind: str, sets: tuple[str, ...], volume: dict) -> None:
    """Triton's cache and flashinfer's JIT workspace sit on the engine.kernelCache volume of every worker
    (a worker without them compiles for tens of seconds before serving); the router compiles nothing."""
    docs = render("gpu", sets)
    for role in ("prefill", "decode"):
        spec = deployment(docs, role)["spec"]["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "kernel-cache"]
        assert {k: v for k, v in vol.items() if k != "name"} == volume
        c = spec["containers"][0]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "kernel-cache"]
        env = env_of(c)
        assert env["TRITON_CACHE_DIR"].startswith(mount["mountPath"] + "/")
        assert env["FLASHINFER_WORKSPACE_BASE"] == mount["mountPath"]
    router = deployment(docs, "router")["spec"]["template"]["spec"]
    assert not [v for v in router["volumes"] if v["name"] == "kernel-cache"]
    assert "claimName" in render_fails("gpu", ("engine.kernelCache.type=pvc",))


def test_redis_password_comes_from_a_secret() -> None:
    docs = render("gpu")
    env = env_of(container(docs, "router"))
    assert env["PDSERVE_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "pdserve-redis", "key": "password"}}
    assert env["PDSERVE_REDIS"] == "redis://:$(PDSERVE_REDIS_PASSWORD)@pdserve-redis:6379/0"
    assert not by_kind(docs, "Secret")  # existingSecret: the chart does not create one
    (sts,) = by_kind(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    redis_env = env_of(sts["spec"]["template"]["spec"]["containers"][0])
    assert redis_env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "pdserve-redis", "key": "password"}}
    ext = render("default", ("redis.mode=external", "redis.external.url=rediss://cache.example:6380/2",
                             "redis.auth.existingSecret=cache-pw", "router.replicas=2"))
    env = env_of(container(ext, "router"))
    assert env["PDSERVE_REDIS"] == "rediss://:$(PDSERVE_REDIS_PASSWORD)@cache.example:6380/2"
    assert not by_kind(ext, "StatefulSet")
    assert "shared state" in render_fails("default", ("router.replicas=2",))
    assert "password" in render_fails("default", ("redis.mode=bundled",))


def test_network_policies_open_only_the_request_flow() -> None:
    docs = render("gpu")
    pols = {p["metadata"]["name"].removeprefix(f"{RELEASE}-"): p["spec"]
            for p in by_kind(docs, "NetworkPolicy")}
    deny = pols["default-deny"]
    assert set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny
    assert deny["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE

    def peers(rule: dict) -> set[str]:
        return {p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component", "?")
                for p in rule.get("from", rule.get("to", []))}

    router_in = pols["router"]["ingress"]
    assert [p["port"] for p in router_in[0]["ports"]] == [50051, 8000]  # gRPC and the HTTP door
    prefill_in = pols["prefill"]["ingress"]
    assert peers(prefill_in[0]) == {"router"} and [p["port"] for p in prefill_in[0]["ports"]] == [50051]
    decode_in = pols["decode"]["ingress"]
    assert peers(decode_in[0]) == {"router"} and peers(decode_in[1]) == {"prefill"}
    assert peers(pols["prefill"]["egress"][0]) == {"decode"}
    dns = pols["egress-dns-redis"]["egress"]
    assert {(p["protocol"], p["port"]) for p in dns[0]["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert peers(dns[1]) == {"redis"}
    assert peers(pols["redis"]["ingress"][0]) == {"?"}  # instance-wide selector: every pod of the release
    # tcp transport narrows prefill -> decode to the KV (and gRPC) ports
    tcp = {p["metadata"]["name"]: p["spec"] for p in by_kind(render("gpu", ("kvTransport.type=tcp",)),
                                                              "NetworkPolicy")}
    assert {p["port"] for p in tcp[f"{RELEASE}-decode"]["ingress"][1]["ports"]} == {50052, 50051}
    assert not by_kind(render("default"), "NetworkPolicy")


def test_router_discovery_selects_each_pools_endpointslices() -> None:
    """The router lists/watches EndpointSlices by label; Kubernetes labels every slice of a Service with
    kubernetes.io/service-name, so the selector must name exactly that pool's (headless) Service."""
    docs = render("default")
    env = env_of(container(docs, "router"))
    assert env["PDSERVE_DISCOVERY"] == "k8s"
    assert env["PDSERVE_K8S_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    services = {component(s): s for s in by_kind(docs, "Service")}
    for role in ("prefill", "decode"):
        svc = services[role]
        selector = env[f"PDSERVE_{role.upper()}_SELECTOR"]
        assert selector == f"kubernetes.io/service-name={svc['metadata']['name']}"
        assert svc["spec"]["selector"].items() <= (
            deployment(docs, role)["spec"]["template"]["metadata"]["labels"].items())
        # the gRPC port comes first: discovery uses the slice's first port unless told a port name
        assert svc["spec"]["ports"][0]["name"] == "grpc"


@pytest.mark.parametrize("preset", PRESETS)
def test_env_matches_the_serve_settings_contract(preset: str) -> None:
    """Every PDSERVE_* variable the chart sets is a `pdserve serve` setting (ServeSettings field)."""
    from dataclasses import fields

    from pdserve.settings import ServeSettings

    known = {f"PDSERVE_{f.name.upper()}" for f in fields(ServeSettings)} | {"PDSERVE_REDIS_PASSWORD"}
    docs = render(preset)
    for role in ROLES:
        c = container(docs, role)
        names = [e["name"] for e in c["env"] if e["name"].startswith("PDSERVE_")]
        assert set(names) <= known, set(names) - known
        assert len(names) == len(set(names))
        assert c["args"] == ["serve", "--role", role]
        env = env_of(c)
        assert env["PDSERVE_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["PDSERVE_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["PDSERVE_BLOCK_SIZE"] == "16"  # router hashes prefixes with the workers' block size


@pytest.mark.parametrize("preset", PRESETS)
def test_containers_run_as_non_root_without_privilege(preset: str) -> None:
    docs = render(preset)
    for role in ROLES:
        spec = deployment(docs, role)["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert not c["securityContext"].get("privileged")


def test_notes_tell_how_to_call_the_router(tmp_path) -> None:
    """NOTES.txt rendered offline: a copy of the chart exposes it through a ConfigMap (helm only renders
    NOTES on install, which needs a cluster)."""
    import shutil

    import yaml
    from chart_helpers import CHART, run_helm

    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    probe = chart / "templates" / "_notes_probe.tpl"
    probe.write_text('{{- define "notes.probe" }}' + notes + "{{- end }}")
    (chart / "templates" / "notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ include "notes.probe" . | quote }}\n')
    out = run_helm("template", RELEASE, str(chart), "--namespace", "pdserve",
                   "--show-only", "templates/notes-probe.yaml").stdout
    text = yaml.safe_load(out)["data"]["notes"]
    assert "port-forward svc/pdserve-router 50051:50051" in text
    assert re.search(r"pdserve client --router 127\.0\.0\.1:50051 --prompt", text)
    assert "helm test pdserve" in text


def test_router_http_door_and_api_keys() -> None:
    """The HTTP door is on by default: a container port, a Service port and PDSERVE_HTTP_PORT agree;
    off, all three go. API keys come from an existing Secret mounted as a directory (so an update
    reaches the file the router re-reads) and named by PDSERVE_API_KEYS_FILE."""
    docs = render("default")
    c = container(docs, "router")
    env = env_of(c)
    assert env["PDSERVE_HTTP_PORT"] == "8000" and "PDSERVE_API_KEYS_FILE" not in env
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    svc = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"] == f"{RELEASE}-router")
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}["http"] == "http"

    docs = render("default", ("router.http.enabled=false", "router.apiKeys.existingSecret=keys",
                              "router.http.servedModelName=llama"))
    c = container(docs, "router")
    env = env_of(c)
    assert "PDSERVE_HTTP_PORT" not in env and all(p["name"] != "http" for p in c["ports"])
    svc = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"] == f"{RELEASE}-router")
    assert all(p["name"] != "http" for p in svc["spec"]["ports"])
    assert env["PDSERVE_API_KEYS_FILE"] == "/etc/pdserve/api-keys/keys"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    assert mount["mountPath"] == "/etc/pdserve/api-keys" and "subPath" not in mount
    vol = next(v for v in deployment(docs, "router")["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "api-keys")
    assert vol["secret"] == {"secretName": "keys", "items": [{"key": "api-keys", "path": "keys"}]}
