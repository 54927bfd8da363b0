"""What only a Kubernetes deployment shows (kind lane only; conftest.py collects this module there).

1. The router finds its workers through the API: every Ready prefill/decode pod is a worker named after
   it at its pod IP, read from the EndpointSlice version the server serves; the release's objects use
   the API versions the cluster serves (Helm rendered them against its capabilities).
2. `kubectl scale` of one pool (prefill) while requests flow: the router sees the new pod and the
   removal without restarting, no request fails, the other pool is untouched.
3. A decode pod deleted at once (--force --grace-period=0) under load: its streams continue on the other
   decode pod token-exact, nothing fails, and Kubernetes' replacement pod takes requests.
4. `kubectl rollout restart` of the decode pool under load: every old pod drains, no request fails.
5. The probes as rendered: the pods carry the manifest's probes, each passes inside its pod, and the
   readiness check tells a wrong service from the right one.
6. The same greedy output with KV over plain TCP: a second release with kvTransport.type=tcp.
7. `helm test`: the chart's test pod reaches the router Service from inside the cluster (by name, or by
   the service variables where the cluster has no DNS).

Each test writes what it measured to the lane's state directory (e2e-<test>.json) for docs/deploy.md.
"""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest
import test_e2e as e2e
from e2e_targets import run
from kind_target import KindTarget

from pdserve.client import Client

pytestmark = [pytest.mark.kind, pytest.mark.timeout(1200)]
reference = e2e.reference  # the single-engine answers, as a fixture of this module too
ROLES = ("router", "prefill", "decode")
MIGRATED = 'pdserve_router_request_retries_total{stage="mid_stream"}'
RETRIED_FIRST = 'pdserve_router_request_retries_total{stage="before_first_token"}'
# Streams of seconds each, so a decode pod is mid-stream when the kubelet kills it (two seconds after a
# forced deletion); the single-engine references (one per prompt, shared by the tests) cost ~15 s each here.
EXACT_TOKENS = 512


def workers(router: str, role: str) -> dict[str, dict]:
    with Client(router, timeout=10) as c:
        return {w["worker_id"]: w for w in c.list_workers() if w["role"] == role and w["healthy"]}


def record(target, name: str, report: dict) -> None:
    (target.state / f"e2e-{name}.json").write_text(json.dumps(report, indent=1))
    print(name, report)


def counter(target, name: str) -> float:
    return target.metrics().get(name, 0.0)


@pytest.fixture(autouse=True)
def chart_pools(target):
    """Each test starts from the chart's pool sizes with the router seeing exactly the Ready pods."""
    for role, n in (("prefill", 2), ("decode", 2)):
        if len(target.pods(role)) != n:
            target.scale(role, n)
        e2e.wait_until(lambda r=role: set(workers(target.router, r)) == {p["metadata"]["name"]
                                                                          for p in target.pods(r)},
                       240, f"the router to see exactly the {role} pods")


class ExactLoad(e2e.Load):
    """Closed-loop greedy clients over a few prompts (their references are computed once), keeping each
    request's prompt and result for a token-exact check afterwards."""

    PROMPTS = e2e.PROMPTS

    def __init__(self, router: str, *, clients: int, max_tokens: int) -> None:
        super().__init__(router, clients=clients, max_tokens=max_tokens, ignore_eos=True)
        self.pairs: list[tuple[str, object]] = []

    def _loop(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            prompt = self.PROMPTS[n % len(self.PROMPTS)]
            n += 1
            try:
                outcome: object = e2e.generate(self.router, prompt, max_tokens=self.max_tokens,
                                               ignore_eos=True)
            except grpc.RpcError as exc:
                outcome = f"{exc.code().name}: {exc.details()}"
            with self._lock:
                self.results.append((time.perf_counter(), outcome))
                self.pairs.append((prompt, outcome))

    def mismatches(self, reference) -> list[str]:
        return [p for p, r in self.pairs if not isinstance(r, str)
                and tuple(r.token_ids) != reference(p, self.max_tokens, True)]


def test_router_discovers_pods_through_the_api(target) -> None:
    served = set(target.kubectl("api-versions").split())
    version = "v1" if "discovery.k8s.io/v1" in served else "v1beta1"
    for role in ("prefill", "decode"):
        pods = {p["metadata"]["name"]: p["status"]["podIP"] for p in target.pods(role)}
        seen = {w: info["address"] for w, info in workers(target.router, role).items()}
        assert seen == {name: f"{ip}:50051" for name, ip in pods.items()}, role
    # The release as Helm rendered it against this cluster: API versions the server serves.
    kinds = {(d["apiVersion"], d["kind"]) for d in target.manifest()}
    pdb = "policy/v1" if "policy/v1" in served else "policy/v1beta1"
    assert {v for v, k in kinds if k == "PodDisruptionBudget"} == {pdb}
    assert all(v in served for v, _ in kinds), sorted(v for v, _ in kinds if v not in served)
    record(target, "discovery", {"endpointslices": f"discovery.k8s.io/{version}", "pdb": pdb,
                                 "kinds": sorted(f"{v} {k}" for v, k in kinds)})


def test_kubectl_scale_of_one_pool_seen_without_router_restart(target) -> None:
    def pod_ids(role: str) -> dict[str, tuple[str, int]]:
        return {p["metadata"]["name"]: (p["metadata"]["uid"],
                                        p["status"]["containerStatuses"][0]["restartCount"])
                for p in target.pods(role)}

    router_before, decode_before = pod_ids("router"), pod_ids("decode")
    prefill_before = set(pod_ids("prefill"))
    with e2e.Load(target.router, clients=2) as load:
        load.wait_done(2)
        start = time.perf_counter()
        target.kubectl("scale", f"deploy/{target.release}-prefill", "--replicas=3")
        grown = e2e.wait_until(lambda: len(workers(target.router, "prefill")) == 3
                               and workers(target.router, "prefill"), 300, "the router to see 3 prefill")
        seen_up = time.perf_counter() - start
        mark = load.done()
        load.wait_done(mark + 3)
        start = time.perf_counter()
        target.kubectl("scale", f"deploy/{target.release}-prefill", "--replicas=2")
        e2e.wait_until(lambda: len(workers(target.router, "prefill")) == 2, 120, "the router to drop one")
        seen_down = time.perf_counter() - start
        mark = load.done()
        load.wait_done(mark + 3)
    assert set(grown) > prefill_before
    assert load.errors() == [], load.errors()
    assert pod_ids("router") == router_before and pod_ids("decode") == decode_before
    record(target, "scale", {"requests": len(load.results), "failed": len(load.errors()),
                             "scale_up_to_router_seen_s": round(seen_up, 1),
                             "scale_down_to_router_dropped_s": round(seen_down, 1)})


def test_deleted_decode_pod_streams_migrate_token_exact(target, reference) -> None:
    before = {p["metadata"]["name"] for p in target.pods("decode")}
    migrated0, retried0 = counter(target, MIGRATED), counter(target, RETRIED_FIRST)
    with ExactLoad(target.router, clients=4, max_tokens=EXACT_TOKENS) as load:
        load.wait_done(4)
        busy = e2e.wait_until(lambda: [w for w, i in workers(target.router, "decode").items()
                                       if i.get("stats", {}).get("num_running", 0) > 0], 60, "decode streams")
        victim = busy[0]
        killed = time.perf_counter()
        target.kill_decode_worker(victim)
        e2e.wait_until(lambda: victim not in workers(target.router, "decode"), 60, f"router to drop {victim}")
        dropped = time.perf_counter() - killed
        new = e2e.wait_until(lambda: [p["metadata"]["name"] for p in target.pods("decode")
                                      if p["metadata"]["name"] not in before], 120, "a replacement pod")[0]
        e2e.wait_until(lambda: new in workers(target.router, "decode"), 300, f"the router to see {new}")
        seen = time.perf_counter() - killed
        def served_by_new() -> float | None:
            with load._lock:
                hit = [t for t, r in load.results
                       if not isinstance(r, str) and r.final["decode_worker"] == new]
            return min(hit) if hit else None

        first_on_new = e2e.wait_until(served_by_new, 180, f"a request served by {new}") - killed
    migrated = counter(target, MIGRATED) - migrated0
    report = {"victim": victim, "replacement": new, "requests": len(load.results),
              "failed": len(load.errors()), "migrated_mid_stream": migrated,
              "retried_before_first_token": counter(target, RETRIED_FIRST) - retried0,
              "router_dropped_victim_s": round(dropped, 1), "router_saw_replacement_s": round(seen, 1),
              "first_request_done_on_replacement_s": round(first_on_new, 1)}
    record(target, "delete-decode-pod", report)
    assert load.errors() == [], load.errors()
    assert migrated >= 1, report
    assert load.mismatches(reference) == []


def test_rolling_restart_of_decode_pool_under_load(target, reference) -> None:
    before = {p["metadata"]["name"] for p in target.pods("decode")}
    migrated0 = counter(target, MIGRATED)
    deploy = f"deploy/{target.release}-decode"
    with ExactLoad(target.router, clients=4, max_tokens=EXACT_TOKENS) as load:
        load.wait_done(4)
        start = time.perf_counter()
        target.kubectl("rollout", "restart", deploy)
        target.kubectl("rollout", "status", deploy, "--timeout=600s", timeout=620)
        rolled = time.perf_counter() - start
        after = {p["metadata"]["name"] for p in target.pods("decode")}
        e2e.wait_until(lambda: set(workers(target.router, "decode")) == after, 120, "router to see new pods")
        mark = load.done()
        load.wait_done(mark + 4)
    report = {"requests": len(load.results), "failed": len(load.errors()),
              "migrated_mid_stream": counter(target, MIGRATED) - migrated0, "rollout_s": round(rolled, 1)}
    record(target, "rolling-restart", report)
    assert not (after & before) and len(after) == 2
    assert load.errors() == [], load.errors()
    assert load.mismatches(reference) == []


def test_probes_as_rendered(target) -> None:
    rendered = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["spec"]
                for d in target.manifest() if d["kind"] in ("Deployment", "StatefulSet")}
    minor = int(json.loads(target.kubectl("version", "-o", "json"))["serverVersion"]["minor"].rstrip("+"))
    checked = 0
    for component, spec in rendered.items():
        (c,) = spec["containers"]
        for pod in target.pods(component):
            (live,) = pod["spec"]["containers"]
            assert [c["status"] for c in pod["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind not in c:
                    continue
                probe = c[kind]
                assert {k: live[kind][k] for k in probe} == probe, (pod["metadata"]["name"], kind)
                if component in ROLES:  # pdserve's own: the kubelet's gRPC probe from 1.24, else exec
                    assert ("grpc" in probe) == (minor >= 24), (component, kind, probe)
                if "exec" in probe:
                    command = probe["exec"]["command"]
                elif "grpc" in probe:  # what the kubelet asks, asked from inside the pod
                    command = ["pdserve-healthcheck", "--port", str(probe["grpc"]["port"]),
                               "--service", probe["grpc"].get("service", "")]
                else:  # tcpSocket (Redis' liveness): the kubelet's own check; it has not restarted the pod
                    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["metadata"]["name"]
                    continue
                target.kubectl("exec", pod["metadata"]["name"], "--", *command)
                checked += 1
            if component in ROLES:
                proc = run(["kubectl", "--context", target.context, "-n", target.namespace, "exec",
                            pod["metadata"]["name"], "--", "pdserve-healthcheck", "--port", "50051",
                            "--service", "pdserve.v1.Nope"], timeout=60, env=target.env, check=False)
                assert proc.returncode != 0, "the health check must tell a wrong service from the right one"
    assert checked >= 5 * 3 + 1  # router, 2 prefill, 2 decode: three probes each; Redis: readiness
    record(target, "probes", {"server_minor": minor, "probes_run": checked,
                              "kind": "grpc" if minor >= 24 else "exec pdserve-healthcheck"})


def test_greedy_output_over_tcp_kv(target, reference, tmp_path_factory) -> None:
    start = time.perf_counter()
    tcp = KindTarget(tmp_path_factory.mktemp("kind-tcp"), release="pdserve-tcp", build=False, transport="tcp",
                     helm_args=("--set", "kvTransport.type=tcp", "--set", "prefill.replicas=1",
                                "--set", "decode.replicas=1", "--set", "redis.mode=none"))
    installed = time.perf_counter() - start
    try:
        batch = e2e.PROMPTS * 2
        results = [e2e.generate(tcp.router, p) for p in batch]
        for prompt, r in zip(batch, results, strict=True):
            assert tuple(r.token_ids) == reference(prompt), f"tcp: output differs for {prompt[:30]!r}"
            assert r.final["transport"] == "tcp"
    finally:
        tcp.close()
    record(target, "tcp-release", {"install_to_ready_s": round(installed, 1), "requests": len(batch)})


def test_helm_test_reaches_the_router_from_inside(target) -> None:
    start = time.perf_counter()
    out = run([target.env["HELM"], "test", target.release, "--kube-context", target.context,
               "-n", target.namespace, "--timeout", "5m"], timeout=360, env=target.env).stdout
    assert re.search(r"Phase:\s+Succeeded", out), out  # the pod itself is gone: hook-succeeded deletes it
    record(target, "helm-test", {"seconds": round(time.perf_counter() - start, 1)})
