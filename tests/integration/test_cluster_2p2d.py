"""Two prefill + two decode workers, KV over NIXL (UCX restricted to TCP: simulated RDMA).

Greedy output through the cluster equals the in-process engine for concurrent requests spread
over both pools (round robin, named explicitly); and, on a cluster of its own (1 prefill + 2
decode, so that no other test runs on what it breaks, in whatever order they run; migration and
restarts off, so the failure itself is what is seen: tests/integration/test_faults_*.py cover both),
a decode worker is SIGKILLed while it serves a request: that request ends with UNAVAILABLE (no hang)
and the cluster keeps serving on the remaining workers.
"""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest
from test_cluster_1p1d import MAX_TOKENS, prompts, reference, run_concurrently

from pdserve.app.launcher.local import LocalCluster, get_stats, ucx_tcp_env
from pdserve.app.launcher.supervisor import RestartPolicy
from pdserve.client import Client

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def nixl_cluster(model, run_dir, *, prefill: int, decode: int, **kw):
    with LocalCluster(model, prefill=prefill, decode=decode, transport="nixl", env=ucx_tcp_env(),
                      policy="round_robin", run_dir=run_dir, **kw) as c:
        c.model = model
        c.start_free = c.free_blocks()
        yield c


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    with nixl_cluster(make_checkpoint("llama"), tmp_path_factory.mktemp("c2p2d"), prefill=2, decode=2) as c:
        yield c


@pytest.fixture
def doomed_cluster(make_checkpoint, tmp_path):
    with nixl_cluster(make_checkpoint("llama"), tmp_path, prefill=1, decode=2,
                      router_args=("--migration", "off"), restart=RestartPolicy(enabled=False)) as c:
        yield c


def test_greedy_matches_engine_over_nixl(cluster) -> None:
    ps = prompts() * 2
    mt = MAX_TOKENS * 2
    want = reference(cluster.model, ps, mt)
    got = run_concurrently(cluster.router, ps, mt)
    assert [r.token_ids for r in got] == want
    assert {r.final["transport"] for r in got} == {"nixl"}
    # round robin spreads the 12 requests over both workers of each pool
    assert len({r.final["prefill_worker"] for r in got}) == 2
    assert len({r.final["decode_worker"] for r in got}) == 2
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free


def test_killed_decode_worker_fails_its_request_and_cluster_keeps_serving(doomed_cluster) -> None:
    cluster = doomed_cluster
    outcome: dict = {}
    started = threading.Event()

    def long_request() -> None:
        try:
            with Client(cluster.router, timeout=120) as c:
                for msg in c.stream(prompt_ids=prompts()[4], max_tokens=1500, ignore_eos=True):
                    if msg.token_ids and "decode" not in outcome:
                        outcome["first"] = True
                        started.set()
                outcome["finished"] = True
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()
            started.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert started.wait(60)
    # find the decode worker that holds it and kill it without a drain
    victim = None
    deadline = time.monotonic() + 30
    while victim is None and time.monotonic() < deadline:
        for h in cluster.workers:
            if h.role == "decode" and h.alive():
                s = get_stats(h.address, "decode")
                if s.num_running + s.num_leased > 0:
                    victim = h
        time.sleep(0.05)
    assert victim is not None, "no decode worker holds the request"
    cluster.kill(victim)
    t.join(60)
    assert not t.is_alive(), "the request hung after its decode worker died"
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    # new requests are served by the surviving decode worker
    survivors = [h for h in cluster.workers if h.role == "decode" and h.alive()]
    assert len(survivors) == 1
    with Client(cluster.router, timeout=60) as c:
        for p in prompts()[:4]:
            r = c.generate(prompt_ids=p, max_tokens=3)
            assert len(r.token_ids) == 3 and r.final["decode_worker"] == survivors[0].worker_id
    start = {w: n for w, n in cluster.start_free.items() if w != victim.worker_id}
    stats = cluster.wait_idle(start)
    assert {w: s.free_blocks for w, s in stats.items()} == start
