"""The planner's Kubernetes actuator (``pdserve/app/planner/k8s.py``, ``lease.py``) against a real API server,
acting as the planner's ServiceAccount with the chart's own rendered RBAC (client impersonation).

The API server: ``PDSERVE_TEST_KUBECONFIG``, else ``KUBECONFIG``, else ``/var/tmp/k8s-local/kubeconfig``
(``/work/shared/k8s-local/setup.sh``: kind, Kubernetes 1.20); context ``PDSERVE_TEST_KUBE_CONTEXT``, else
``kind-kp`` where the kubeconfig has it, else its current one (planner_k8s_api.py). None answering: the
module is skipped, and says why. Each run works in a namespace of its own (``pdserve-planner-<random>``),
deleted at the end.

The pools are Deployments named as the chart names them (release "pdserve") running the pause image; only
their scale subresource matters, except where a resize waits for pods to be Ready. Lease timings are
seconds (duration 3, renew deadline 2, retry 0.2), so the module takes well under a minute.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from planner_k8s_api import (
    CHART,
    FULL,
    LEASE,
    OUTSIDER,
    POOLS,
    SA,
    CannedMetrics,
    Partition,
    actuator,
    as_planner,
    connect,
    decision,
    fresh_lease,
    own_address,
    planner_namespace,
    pool_deployment,
    run_helm,
    scale_by_hand,
    scale_of,
    wait_for,
)

from pdserve.app.planner.actuator import APPLIED, COOL_DOWN, STANDBY
from pdserve.app.planner.k8s import (
    LAST_CHANGES,
    KubernetesActuator,
    Release,
    ResizedMeanwhile,
    endpoint_targets,
)
from pdserve.app.planner.policy import PlannerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def kube():
    return connect()


@pytest.fixture(scope="module")
def ns(kube):
    with planner_namespace(kube) as name:
        yield name


# ---------------------------------------------------------------- scaling
def test_scales_each_pool_through_the_scale_subresource_and_follows_hand_changes(kube, ns):
    from kubernetes import client

    scale_by_hand(kube, ns, "prefill", 1)
    scale_by_hand(kube, ns, "decode", 1)
    act = actuator(kube, ns)
    assert act.replicas("prefill") == 1 and act.replicas("decode") == 1
    (a,) = act.apply(decision(prefill=(1, 3), decode=(1, 1)))
    assert (a.pool, a.outcome, a.before, a.target) == ("prefill", APPLIED, 1, 3)
    assert scale_of(kube, ns, "prefill") == 3 and scale_of(kube, ns, "decode") == 1
    (a,) = act.apply(decision(prefill=(3, 3), decode=(1, 2)))
    assert (a.pool, a.outcome) == ("decode", APPLIED) and scale_of(kube, ns, "decode") == 2

    scale_by_hand(kube, ns, "prefill", 1)  # `kubectl scale --replicas 1`: handed back, not undone
    assert act.apply(decision(prefill=(3, 3), decode=(2, 2))) == []
    assert scale_of(kube, ns, "prefill") == 1
    assert act.planner._state["prefill"].target == 1  # its next decision starts from what the pool has

    act.replicas("decode")  # this window's read ...
    scale_by_hand(kube, ns, "decode", 4)  # ... then a hand change before the PATCH: never overwritten
    with pytest.raises(ResizedMeanwhile):
        act.resize("decode", 1)
    assert scale_of(kube, ns, "decode") == 4
    act.replicas("decode")  # a read, then a write that moves the resourceVersion but not the replicas (as
    client.AppsV1Api(kube[2]).patch_namespaced_deployment(  # the controller's status updates do): retried
        POOLS["decode"], ns, {"metadata": {"annotations": {"touched": "yes"}}},
        _content_type="application/merge-patch+json")
    act.resize("decode", 2)
    assert scale_of(kube, ns, "decode") == 2


def test_a_resize_waits_for_the_pods_and_the_pods_are_its_targets(kube, ns):
    act = actuator(kube, ns, settle=90.0)
    scale_by_hand(kube, ns, "prefill", 1)
    scale_by_hand(kube, ns, "decode", 1)
    (a,) = act.apply(decision(prefill=(1, 2)))
    if a.note:
        pytest.skip(f"this cluster does not run the pause image ({a.note}): the settle wait is untested here")
    assert a.outcome == APPLIED
    from kubernetes import client

    dep = client.AppsV1Api(kube[2]).read_namespaced_deployment(POOLS["prefill"], ns)
    assert dep.status.ready_replicas == 2 and dep.status.replicas == 2  # ready before the action ended
    targets = endpoint_targets(client.CoreV1Api(as_planner(kube, ns)), ns, Release(
        namespace=ns, fullname=FULL).services())
    deadline = time.monotonic() + 30
    while len([t for t in targets() if t.role == "prefill"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    found = targets()  # read as the planner: `get` on the three named Endpoints is all it may do
    assert [t.role for t in found].count("prefill") == 2 and {t.role for t in found} == {"router", "prefill",
                                                                                          "decode"}
    for t in found:
        assert t.address.endswith(":9090") and t.process.startswith(f"{FULL}-{t.role}-"), t


def test_the_role_refuses_what_it_does_not_grant(kube, ns):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api = as_planner(kube, ns)
    apps, core, coord = client.AppsV1Api(api), client.CoreV1Api(api), client.CoordinationV1Api(api)
    client.CoordinationV1Api(kube[2]).create_namespaced_lease(ns, {"metadata": {"name": "someone-elses"},
                                                                   "spec": {"holderIdentity": "x"}})
    refused = {
        "scale a third Deployment": lambda: apps.patch_namespaced_deployment_scale(
            OUTSIDER, ns, {"spec": {"replicas": 2}}, _content_type="application/merge-patch+json"),
        "read a third Deployment's scale": lambda: apps.read_namespaced_deployment_scale(OUTSIDER, ns),
        "change a pool's Deployment itself": lambda: apps.patch_namespaced_deployment(
            POOLS["decode"], ns, {"spec": {"revisionHistoryLimit": 1}},
            _content_type="application/merge-patch+json"),
        "list Deployments": lambda: apps.list_namespaced_deployment(ns),
        "read a Secret": lambda: core.read_namespaced_secret("default-token", ns),
        "list Secrets": lambda: core.list_namespaced_secret(ns),
        "delete a pod": lambda: core.delete_namespaced_pod("any-pod", ns),
        "list pods": lambda: core.list_namespaced_pod(ns),
        "list Endpoints": lambda: core.list_namespaced_endpoints(ns),
        "read another Lease": lambda: coord.read_namespaced_lease("someone-elses", ns),
        "delete its own Lease": lambda: coord.delete_namespaced_lease(SA, ns),
        "anything in another namespace": lambda: apps.read_namespaced_deployment_scale(POOLS["decode"],
                                                                                      "default"),
    }
    for what, call in refused.items():
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403, f"{what}: {err.value.status} {err.value.reason}"
    # and what it is granted, read back as the same identity
    assert apps.read_namespaced_deployment(POOLS["prefill"], ns).metadata.name == POOLS["prefill"]
    assert core.read_namespaced_endpoints(f"{FULL}-router", ns).metadata.name == f"{FULL}-router"


def test_this_api_server_accepts_the_rendered_planner(kube, ns):
    """The planner's Deployment and NetworkPolicies as the chart renders them, created server-side in dry-run
    mode: this API server's own validation (its version), beyond the offline schemas of the chart tests."""
    from kubernetes import utils

    rendered = run_helm("template", FULL, str(CHART), "--namespace", ns, "--set", "planner.enabled=true",
                        "--set", "networkPolicy.enabled=true", "--set", "planner.profile.configMap=sweep",
                        "-s", "templates/planner.yaml").stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert sorted(d["kind"] for d in docs) == ["Deployment", "NetworkPolicy", "NetworkPolicy"]
    for doc in docs:
        utils.create_from_dict(kube[2], doc, namespace=ns, dry_run="All")


# ---------------------------------------------------------------- leader election
class Contender:
    """A planner replica's loop, fast: every 0.05 s a decision moving prefill to whichever of ``wants`` it
    is not at, handed to the actuator (so a leader always has a change to apply)."""

    def __init__(self, act: KubernetesActuator, wants: tuple[int, int]) -> None:
        self.act, self.wants = act, wants
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Contender:
        self.act.start()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            try:
                have = self.act.replicas("prefill")
                want = self.wants[0] if have != self.wants[0] else self.wants[1]
                self.act.apply(decision(prefill=(have, want), decode=(1, 1)))
            except Exception:  # noqa: BLE001 - the API server may refuse a moment; the assertions judge
                pass

    def stop(self, *, release: bool = True) -> None:
        self._stop.set()
        self._thread.join(10)
        self.act.close(release=release)

    def applied(self) -> list:
        return [a for a in self.act.actions if a.outcome == APPLIED and a.pool == "prefill"]


def test_one_leader_acts_and_hands_over_on_release_and_on_expiry(kube, ns):
    from kubernetes import client

    lease = fresh_lease(kube, ns)
    seen: list[tuple[float, int]] = []  # (when, prefill replicas) as the admin reads them
    watching = threading.Event()

    def observe() -> None:
        apps = client.AppsV1Api(kube[2])
        while not watching.is_set():
            n = apps.read_namespaced_deployment_scale(POOLS["prefill"], ns).spec.replicas
            if not seen or seen[-1][1] != n:
                seen.append((time.monotonic(), n))
            time.sleep(0.02)

    scale_by_hand(kube, ns, "prefill", 1)
    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    a = Contender(actuator(kube, ns, lease=lease, identity="a"), (2, 4)).start()
    wait_for(a.act.leading, 5, "a leads an absent lease")
    b = Contender(actuator(kube, ns, lease=lease, identity="b"), (3, 5)).start()
    wait_for(lambda: len(a.applied()) >= 4, 10, "the leader scales")
    assert not b.act.leading() and not b.applied()
    assert {x.outcome for x in b.act.actions} <= {STANDBY}  # b decides, and stands by

    # a clean stop releases the lease: b takes over at its next step, well before the lease would expire
    a.stop(release=True)
    released = time.monotonic()
    took = wait_for(b.act.leading, LEASE["lease_duration_s"], "b takes over a released lease")
    assert took - released < LEASE["lease_duration_s"] - 0.5
    wait_for(lambda: len(b.applied()) >= 4, 10, "the new leader scales")
    assert a.applied()[-1].finished < b.applied()[0].started

    # b is cut off from the API server but its loop goes on: it must stop acting before c may start
    c = Contender(actuator(kube, ns, lease=lease, identity="c"), (6, 8)).start()
    partition = Partition(b.act.elector.api)
    b.act.elector.api = partition
    wait_for(lambda: not c.act.leading() and c.act.elector.holder == "b", 5, "c follows b")
    partition.cut = True
    cut = time.monotonic()
    wait_for(lambda: not b.act.leading(), LEASE["renew_deadline_s"] + 1, "b stops leading by its deadline")
    took = wait_for(c.act.leading, LEASE["lease_duration_s"] + 3, "c takes over an expired lease")
    assert took - cut >= LEASE["lease_duration_s"] - LEASE["renew_deadline_s"]  # not before b's lease expired
    wait_for(lambda: len(c.applied()) >= 4, 10, "the third leader scales")
    b_last, c_first = b.applied()[-1], c.applied()[0]
    assert b_last.finished < c_first.started, "two leaders acted at once"
    assert b_last.finished < cut + LEASE["renew_deadline_s"]
    b.stop(release=True)
    c.stop(release=True)
    watching.set()
    observer.join(5)

    # every replica count the pool had came from one leader's turn: a's, then b's, then c's, never mixed
    owner = {2: "a", 4: "a", 3: "b", 5: "b", 6: "c", 8: "c"}
    turns = [owner[n] for _, n in seen if n in owner]
    assert turns[0] == "a" and turns[-1] == "c"
    compressed = [t for i, t in enumerate(turns) if i == 0 or turns[i - 1] != t]
    assert compressed == ["a", "b", "c"], compressed
    holder = client.CoordinationV1Api(kube[2]).read_namespaced_lease(lease, ns)
    assert holder.spec.holder_identity is None and holder.spec.lease_transitions >= 2  # released at the end


def test_cool_downs_survive_a_change_of_leader(kube, ns):
    from kubernetes import client

    slow = PlannerConfig(min_prefill=0, max_prefill=9, min_decode=0, max_decode=9, up_cooldown_s=60.0,
                         down_cooldown_s=60.0)
    scale_by_hand(kube, ns, "prefill", 1)
    lease = fresh_lease(kube, ns)
    a = actuator(kube, ns, lease=lease, identity="a", config=slow)
    assert a.elector.step() and a.leading()
    (done,) = a.apply(decision(prefill=(1, 2)))
    assert done.outcome == APPLIED
    a.close(release=True)  # a clean stop: the record of the change stays on the Lease
    annotations = client.CoordinationV1Api(kube[2]).read_namespaced_lease(lease, ns).metadata.annotations
    assert '"prefill"' in annotations[LAST_CHANGES]

    b = actuator(kube, ns, lease=lease, identity="b", config=slow)
    assert b.elector.step() and b.leading()
    (refused,) = b.apply(decision(prefill=(2, 3)))
    assert refused.outcome == COOL_DOWN and "cool-down 60 s" in refused.error
    assert scale_of(kube, ns, "prefill") == 2
    b.close(release=True)


# ---------------------------------------------------------------- the command
def test_the_command_scales_a_release_from_its_metrics(kube, ns):
    """`pdserve planner run --actuator kubernetes` as a process, for a release "cli" whose Services point (by
    hand-made Endpoints) at canned metrics on this host: the burst's window scales prefill up through the
    scale subresource, and SIGTERM (a pod's stop) ends it cleanly and releases the Lease."""
    from kubernetes import client

    host = own_address()
    if host is None or host.startswith("127."):
        pytest.skip("this host has no non-loopback address for an Endpoints object to point at")
    admin = kube[2]
    apps, core = client.AppsV1Api(admin), client.CoreV1Api(admin)
    metrics = CannedMetrics(host)
    try:
        for pool in ("prefill", "decode"):
            apps.create_namespaced_deployment(ns, pool_deployment(f"cli-{pool}", f"cli-{pool}"))
        for role, port in zip(("router", "prefill", "decode"), metrics.ports(), strict=True):
            core.create_namespaced_service(ns, {"metadata": {"name": f"cli-{role}"}, "spec": {
                "ports": [{"name": "metrics", "port": 9090}]}})  # no selector: the Endpoints are ours
            core.create_namespaced_endpoints(ns, {"metadata": {"name": f"cli-{role}"}, "subsets": [{
                "addresses": [{"ip": host}], "ports": [{"name": "metrics", "port": port}]}]})
        path, context, _ = kube
        argv = [sys.executable, "-m", "pdserve.app.cli", "--log-level", "INFO", "planner", "run",
                "--actuator", "kubernetes", "--kubeconfig", path, "--namespace", ns, "--release", "cli",
                "--interval", "0.5", "--max-prefill", "3", "--max-decode", "2", "--up-cooldown", "0",
                "--down-cooldown", "600", "--settle-timeout", "0", "--lease-duration", "3",
                "--renew-deadline", "2", "--retry-period", "0.2"]
        argv += ["--context", context] if context else []
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=Path(__file__).resolve().parents[2])
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            wait_for(lambda: any("prefill up 1 -> 3" in ln and "[applied in" in ln for ln in lines)
                     or proc.poll() is not None, 90, "the command scales prefill")
            proc.send_signal(signal.SIGTERM)  # what the kubelet sends a pod: the loop stops, the Lease goes
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            reader.join(5)
        out = "".join(lines)
        print(out[-4000:])
        assert "leads: it scales the pools" in out and "autoscale: prefill up 1 -> 3" in out
        assert apps.read_namespaced_deployment_scale("cli-prefill", ns).spec.replicas == 3
        lease = client.CoordinationV1Api(admin).read_namespaced_lease("cli-planner", ns)
        assert lease.spec.holder_identity is None  # released on SIGTERM
        assert '"prefill"' in lease.metadata.annotations[LAST_CHANGES]
    finally:
        metrics.close()
