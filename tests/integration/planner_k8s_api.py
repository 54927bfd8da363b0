"""What tests/integration/test_planner_k8s.py needs of a real API server: finding one (or the reason its
module is skipped), a namespace of its own with the pools, their Services and the chart's rendered planner
RBAC, clients acting as the planner's ServiceAccount (impersonation), and small helpers (hand-made
decisions, a partition of the elector from the API server, canned metrics endpoints on this host).

The API server: ``PDSERVE_TEST_KUBECONFIG``, else ``KUBECONFIG``, else ``/var/tmp/k8s-local/kubeconfig``
(``/work/shared/k8s-local/setup.sh``: kind, Kubernetes 1.20); context ``PDSERVE_TEST_KUBE_CONTEXT``, else
``kind-kp`` where the kubeconfig has it, else its current one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from pdserve.app.planner.k8s import KubernetesActuator, Release
from pdserve.app.planner.lease import LeaseConfig
from pdserve.app.planner.policy import Decision, Planner, PlannerConfig, PoolDecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
from chart_helpers import CHART, run_helm  # noqa: E402

FULL = "pdserve"  # release "pdserve": the chart's full name is the release name
SA = f"{FULL}-planner"
POOLS = {"prefill": f"{FULL}-prefill", "decode": f"{FULL}-decode"}
OUTSIDER = f"{FULL}-router"  # a Deployment the Role does not name
FAST = PlannerConfig(min_prefill=0, max_prefill=9, min_decode=0, max_decode=9, up_cooldown_s=0.0,
                     down_cooldown_s=0.0)
LEASE = dict(lease_duration_s=3, renew_deadline_s=2.0, retry_period_s=0.2)


# ---------------------------------------------------------------- the API server
def _kubeconfig() -> tuple[str | None, str | None]:
    path = next((p for p in (os.environ.get("PDSERVE_TEST_KUBECONFIG"), os.environ.get("KUBECONFIG"),
                             "/var/tmp/k8s-local/kubeconfig") if p and Path(p).is_file()), None)
    if path is None:
        return None, None
    context = os.environ.get("PDSERVE_TEST_KUBE_CONTEXT")
    if context is None:
        kubeconfig = yaml.safe_load(Path(path).read_text()) or {}
        contexts = {c.get("name") for c in kubeconfig.get("contexts") or ()}
        context = "kind-kp" if "kind-kp" in contexts else None
    return path, context


def connect():
    """(kubeconfig, context, an admin ApiClient), or the calling module is skipped with the reason."""
    try:
        from kubernetes import client, config
    except ImportError:
        pytest.skip("the kubernetes client is not installed (pip install 'pdserve[cluster]')")
    path, context = _kubeconfig()
    if path is None:
        pytest.skip("no Kubernetes API server: set PDSERVE_TEST_KUBECONFIG (or KUBECONFIG), or start one "
                    "with /work/shared/k8s-local/setup.sh (kubeconfig /var/tmp/k8s-local/kubeconfig)")
    try:
        admin = config.new_client_from_config(config_file=path, context=context, persist_config=False)
        version = client.VersionApi(admin).get_code(_request_timeout=5)
    except Exception as exc:  # noqa: BLE001 - whatever it is, there is no server to test against
        pytest.skip(f"the API server of {path} (context {context or 'current'}) does not answer: "
                    f"{type(exc).__name__}: {exc}")
    print(f"API server {version.git_version} ({path}, context {context or 'current'})")
    return path, context, admin


def as_planner(kube, namespace: str):
    """An ApiClient whose every request acts as the planner's ServiceAccount (the admin may impersonate)."""
    from kubernetes import config

    path, context, _ = kube
    api = config.new_client_from_config(config_file=path, context=context, persist_config=False)
    api.set_default_header("Impersonate-User", f"system:serviceaccount:{namespace}:{SA}")
    return api


def pool_deployment(name: str, component: str) -> dict:
    """A pool's Deployment as the test needs it: the chart's labels, one pause container, tiny requests."""
    labels = {"app.kubernetes.io/instance": FULL, "app.kubernetes.io/component": component}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": False,
                         "containers": [{"name": "pause", "image": "k8s.gcr.io/pause:3.2",
                                         "imagePullPolicy": "IfNotPresent",
                                         "resources": {"requests": {"cpu": "1m", "memory": "8Mi"},
                                                       "limits": {"cpu": "50m", "memory": "32Mi"}}}]}}}}


@contextlib.contextmanager
def planner_namespace(kube):
    """A namespace with the pools (and a third Deployment), their Services, and the chart's planner RBAC
    as ``helm template`` renders it; deleted on the way out."""
    from kubernetes import client, utils

    _, _, admin = kube
    name = f"pdserve-planner-{secrets.token_hex(3)}"
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": name, "labels": {"pdserve.io/test": "planner-k8s"}}})
    try:
        apps = client.AppsV1Api(admin)
        for component, dep in (*((pool, POOLS[pool]) for pool in POOLS), ("router", OUTSIDER)):
            apps.create_namespaced_deployment(name, pool_deployment(dep, component))
            core.create_namespaced_service(name, {"metadata": {"name": dep}, "spec": {
                "clusterIP": "None", "selector": {"app.kubernetes.io/instance": FULL,
                                                  "app.kubernetes.io/component": component},
                "ports": [{"name": "metrics", "port": 9090}]}})
        rendered = run_helm("template", FULL, str(CHART), "--namespace", name, "--set",
                            "planner.enabled=true", "-s", "templates/planner-rbac.yaml").stdout
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding"]
        for doc in docs:
            utils.create_from_dict(admin, doc, namespace=name)
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


def scale_of(kube, ns: str, pool: str) -> int:
    from kubernetes import client

    return client.AppsV1Api(kube[2]).read_namespaced_deployment_scale(POOLS[pool], ns).spec.replicas


def scale_by_hand(kube, ns: str, pool: str, n: int) -> None:
    """What `kubectl scale` does, as the admin."""
    from kubernetes import client

    client.AppsV1Api(kube[2]).patch_namespaced_deployment_scale(
        POOLS[pool], ns, {"spec": {"replicas": n}}, _content_type="application/merge-patch+json")


def decision(**pools: tuple[int, int]) -> Decision:
    """``prefill=(current, target)``; pools not named hold at their current replicas (target == current)."""
    out = []
    for pool in ("prefill", "decode"):
        cur, target = pools.get(pool, (0, 0))
        direction = "up" if target > cur else "down" if target < cur else "hold"
        out.append(PoolDecision(pool=pool, current=cur, target=target, required=float(target),
                                direction=direction, reason=f"{direction} {cur} -> {target}"))
    return Decision(at=time.monotonic(), pools=tuple(out))


def actuator(kube, ns: str, *, lease: str | None = None, identity: str = "", config: PlannerConfig = FAST,
             settle: float = 0.0) -> KubernetesActuator:
    lc = LeaseConfig(namespace=ns, name=lease, identity=identity, **LEASE) if lease else None
    return KubernetesActuator(as_planner(kube, ns), Release(namespace=ns, fullname=FULL),
                              Planner(config, clock=time.monotonic), lease=lc, settle_timeout_s=settle,
                              settle_poll_s=0.2)


class Partition:
    """The elector's API, cut off at will: every call raises as an unreachable API server would."""

    def __init__(self, api) -> None:
        self.api, self.cut = api, False

    def __getattr__(self, name: str):
        attr = getattr(self.api, name)

        def call(*args, **kwargs):
            if self.cut:
                raise ConnectionError("partitioned from the API server")
            return attr(*args, **kwargs)

        return call


def fresh_lease(kube, ns: str) -> str:
    """The planner's Lease (the only one its Role may read or renew), deleted first by the admin."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        client.CoordinationV1Api(kube[2]).delete_namespaced_lease(SA, ns)
    except ApiException as exc:
        if exc.status != 404:
            raise
    return SA


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic()


class CannedMetrics:
    """One metrics endpoint per role on this host's own address: each scrape answers the next of its canned
    expositions (tests/unit/test_planner_cli.py's two windows: a burst with prompts queued), then the last."""

    def __init__(self, host: str) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from tests.unit.test_planner_cli import two_windows

        self.servers = []
        for texts in two_windows().values():
            served = {"n": 0}

            class Handler(BaseHTTPRequestHandler):
                def do_GET(self, texts=texts, served=served) -> None:  # noqa: N802 - http.server's name
                    body = texts[min(served["n"], len(texts) - 1)].encode()
                    served["n"] += 1
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, *args) -> None:
                    pass

            server = ThreadingHTTPServer((host, 0), Handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)

    def ports(self) -> list[int]:  # router, prefill, decode
        return [s.server_address[1] for s in self.servers]

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


def own_address() -> str | None:
    """This host's address on its default route (an Endpoints address may not be a loopback one)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return None


