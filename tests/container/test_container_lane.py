"""The e2e suite against the Helm chart's pods running as Docker containers, once per KV transport.

Every test of tests/e2e/test_e2e.py runs here unchanged against ``target`` (a ContainerCluster: see
lane.py): token-exact output through the router (gRPC and the OpenAI-compatible HTTP door), session
affinity, scaling the decode pool while requests flow, losing a decode container (SIGKILL) under load.
Then what only a container deployment shows: every probe the chart declares passes inside every
container, and `docker stop` of a decode container under load (the chart's preStop hook, then SIGTERM
with the rest of its grace period) drains: its in-flight streams finish or end UNAVAILABLE, it exits by
itself before the grace period runs out, the router keeps serving, and no KV block stays taken on the
other workers.

The tests share one cluster per transport. The lane runs them in file order (the e2e tests first, in
their own order), which restarts the fewest containers; in any other order each test still starts from
the chart's decode replica count (``chart_replicas``), so none leans on what another left behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest
import test_e2e as e2e

from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

pytestmark = pytest.mark.timeout(1200)

# The e2e suite, collected in this module against the container target: every test of test_e2e.py, in
# its order, with its fixtures (``reference``).
reference = e2e.reference
globals().update({name: fn for name, fn in vars(e2e).items() if name.startswith("test_") and callable(fn)})


@pytest.fixture(autouse=True)
def chart_replicas(target):
    """Before each test: as many decode containers as the chart's replicas (a kill or a drain shrinks the
    pool; Kubernetes would replace the pod, here a new container is started), all seen by the router."""
    want = target.templates["decode"].replicas
    if len(target.pods["decode"]) != want:
        target.scale_decode(want)
    live = set(target.pods["decode"])
    e2e.wait_until(lambda: {w["worker_id"] for w in e2e.decode_workers(target.router)} == live, 180,
                   f"the router to see exactly {sorted(live)}")


# Where the lane keeps what it measured (deploy/container/common.sh's $STATE).
STATE = Path(os.environ.get("PDSERVE_LANE_STATE",
                            Path(__file__).resolve().parents[2] / ".run" / "container-lane"))
STUBS = {"decode": decode_pb2_grpc.DecodeStub, "prefill": prefill_pb2_grpc.PrefillStub}


def worker_stats(target, pod: str) -> common_pb2.WorkerStats:
    role = target.component_of[pod]
    with grpc.insecure_channel(target.address(pod)) as channel:
        return STUBS[role](channel).GetStats(common_pb2.StatsRequest(), timeout=10)


def idle_free_blocks(target, pods: list[str]) -> dict[str, int]:
    """Free blocks of each pod once nothing is running, leased or queued there."""

    def settled():
        stats = {p: worker_stats(target, p) for p in pods}
        if all(s.num_running == 0 and s.num_leased == 0 and s.queue_depth == 0 for s in stats.values()):
            return {p: s.free_blocks for p, s in stats.items()}
        return None

    return e2e.wait_until(settled, 60, f"{pods} to go idle")


def test_lane_cluster_is_the_chart(target) -> None:
    """The running containers carry the rendered chart's settings, read back from Docker."""
    for pods in target.pods.values():
        for pod in pods:
            spec = target.specs[pod]
            cfg = target.inspect(pod)
            env = dict(e.split("=", 1) for e in cfg["Config"]["Env"])
            assert {k: env.get(k) for k in spec.env} == spec.env, pod
            assert cfg["Config"]["User"] == spec.user
            assert cfg["HostConfig"]["ReadonlyRootfs"] is spec.read_only
            assert cfg["Config"]["Image"] == spec.image
            assert list(cfg["Config"]["Cmd"] or []) == list(spec.args)
            assert cfg["HostConfig"]["RestartPolicy"]["Name"] == spec.restart == "always"


def test_every_chart_probe_passes_in_every_container(target) -> None:
    checked = 0
    for component, pods in target.pods.items():
        for pod in pods:
            probes = target.specs[pod].probes
            assert "readiness" in probes, f"{pod}: the chart gives {component} no readiness probe"
            for kind in probes:
                p = target.exec_probe(pod, kind)
                assert p.returncode == 0, f"{pod} {kind} probe {probes[kind].command}: {p.stdout}{p.stderr}"
                checked += 1
    assert {"redis", "router", "prefill", "decode"} <= {c for c, pods in target.pods.items() if pods}
    assert checked >= 10


def test_docker_stop_drains_a_decode_container_under_load(target) -> None:
    victim, survivor = target.pods["decode"]
    others = [survivor, *target.pods["prefill"]]
    free_before = idle_free_blocks(target, others)
    at_sigterm: dict[str, object] = {}

    def streams_in_flight_on_victim() -> None:
        # What the kubelet would do after preStop; first make sure the victim is really mid-stream. The
        # count kept is the one that ended the wait: a second read could already see those streams done.
        seen: list[int] = []

        def running() -> bool:
            seen.append(worker_stats(target, victim).num_running)
            return seen[-1] > 0

        e2e.wait_until(running, 60, f"streams on {victim}")
        at_sigterm["running"] = seen[-1]
        at_sigterm["results"] = len(load.results)

    with e2e.Load(target.router, clients=4, max_tokens=64) as load:
        load.wait_done(4)
        stop = target.stop(victim, before_sigterm=streams_in_flight_on_victim)
        mark = load.done()
        load.wait_done(mark + 4)
    # The container drained and exited by itself (exit 0) before the grace period's SIGKILL (exit 137).
    assert stop["exit_code"] == 0 and not stop["oom_killed"], stop
    assert at_sigterm["running"] > 0
    # Every request ended, each with tokens or UNAVAILABLE; the router kept serving after the stop.
    unexpected = [e for e in load.errors() if e.split(":", 1)[0] != "UNAVAILABLE"]
    assert unexpected == [], unexpected
    after_stop = [o for _, o in load.results[at_sigterm["results"]:] if not isinstance(o, str)]
    assert len(after_stop) >= 4 and all(r.finish_reason in e2e.OK_FINISH for r in after_stop)
    finished_on_victim = [r for r in after_stop if r.final["decode_worker"] == victim]
    report = {"lane": target.name, "victim": victim, "streams_at_sigterm": at_sigterm["running"],
              "finished_on_victim_after_sigterm": len(finished_on_victim),
              "unavailable": len(load.errors()), "ok_after_sigterm": len(after_stop),
              "exit_code": stop["exit_code"], "stop_seconds": round(stop["seconds"], 1),
              "grace_seconds": stop["grace_s"]}
    (STATE / f"drain-{target.transport}.json").write_text(json.dumps(report, indent=1))
    print(report)
    new = [e2e.generate(target.router, p) for p in e2e.PROMPTS]
    assert all(r.finish_reason in e2e.OK_FINISH and r.final["decode_worker"] != victim for r in new)
    # No KV block left taken on the workers that stayed.
    assert idle_free_blocks(target, others) == free_before
