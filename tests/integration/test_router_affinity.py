"""Multi-turn conversations keep their KV cache under the router's default policy, real processes.

Two clusters, both with the router at its default policy (``prefix``): 1 prefill + 2 decode workers
(KV over TCP), and 2 colocated workers behind ``--mode colocated``. Conversations are played turn by
turn (nothing else in flight, so both workers are equally idle); turn t+1 = turn t's prompt + its
answer + a few new tokens. Covers, on each cluster: sessions named by the ``session_id`` field and
by ``x-session-affinity`` metadata put every later turn on the session's worker, reusing the KV the
worker kept (``kv_blocks_reused`` > 0, ``session_hit``); the same conversations without a session id
stay warm too (the score counts the decode worker's cached blocks). On the disaggregated cluster, a
session whose worker is driven past the session load bound (leases held on it directly, as another
router's traffic would) moves once, with ``move_reason`` and ``moved_from`` set and the move counted
in the metrics, and then stays on its new worker. Every test ends with the leak checks: every block
back, nothing running or leased, no placement left open in the router.
"""

from __future__ import annotations

import random
import time

import grpc
import pytest

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port
from pdserve.probe import scrape_metrics as scrape
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BS = 16
TURNS = 5


def _cluster(model, run_dir, **kw):
    port = free_port()
    c = LocalCluster(model, run_dir=run_dir, policy="prefix", router_args=("--metrics-port", str(port)),
                     worker_args=("--num-blocks", "256"), **kw)
    c.metrics_port = port
    return c


@pytest.fixture(scope="module")
def disagg(make_checkpoint, tmp_path_factory):
    with _cluster(make_checkpoint("llama"), tmp_path_factory.mktemp("affinity-1p2d"), prefill=1,
                  decode=2) as c:
        c.start_free = c.free_blocks()
        yield c


@pytest.fixture(scope="module")
def colocated(make_checkpoint, tmp_path_factory):
    with _cluster(make_checkpoint("llama"), tmp_path_factory.mktemp("affinity-colocated"), prefill=0,
                  decode=2, colocated=True) as c:
        c.start_free = c.free_blocks()
        yield c


def leak_check(cluster) -> None:
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free
    deadline = time.monotonic() + 30
    while scrape(cluster.metrics_port)["pdserve_router_inflight_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(cluster.metrics_port)["pdserve_router_inflight_requests"] == 0


Finals = dict[str, list[dict]]
History = dict[str, list[int]]


def converse(router: str, names: list[str], *, by: str, seed: int, turns: int = TURNS,
             history: History | None = None) -> tuple[Finals, History]:
    """Play each conversation turn by turn; returns each one's final reports and histories."""
    rng = random.Random(seed)
    hist = history or {s: [rng.randrange(5, 1000) for _ in range(40)] for s in names}
    finals: Finals = {s: [] for s in names}
    with Client(router, timeout=60) as c:
        for _ in range(turns):
            for s in names:
                prompt = hist[s] + [rng.randrange(5, 1000) for _ in range(12)]
                kw = dict(prompt_ids=prompt, max_tokens=8, ignore_eos=True)
                if by == "field":
                    r = c.generate(session_id=s, **kw)
                elif by == "metadata":
                    r = c.generate(metadata=[("x-session-affinity", s)], **kw)
                else:
                    r = c.generate(**kw)
                finals[s].append(r.final)
                hist[s] = prompt + r.token_ids
    return finals, hist


def assert_warm(finals: Finals, *, session: bool) -> None:
    for name, turns in finals.items():
        assert len({f["decode_worker"] for f in turns}) == 1, (name, [f["decode_worker"] for f in turns])
        for f in turns[1:]:
            assert f["kv_blocks_reused"] > 0 and f["usage"]["cached_tokens"] > 0, (name, f)
            assert f["session_hit"] == session and not f["session_moved"] and not f["move_reason"], (name, f)


@pytest.mark.parametrize("by", ["field", "metadata", "none"])
def test_disaggregated_turns_stay_warm(disagg, by) -> None:
    names = [f"d-{by}-{i}" for i in range(3)]
    finals, _ = converse(disagg.router, names, by=by, seed=13 * len(by))
    assert_warm(finals, session=by != "none")
    for turns in finals.values():  # the decode worker held every block of the last turn but its last token
        assert all(f["kv_blocks_sent"] + f["kv_blocks_reused"] > 0 for f in turns)
    leak_check(disagg)


@pytest.mark.parametrize("by", ["field", "metadata", "none"])
def test_colocated_turns_stay_warm(colocated, by) -> None:
    names = [f"c-{by}-{i}" for i in range(3)]
    finals, _ = converse(colocated.router, names, by=by, seed=7 + len(by))
    assert_warm(finals, session=by != "none")
    assert all(f["prefill_mode"] == "local" and f["prefill_mode_reason"] == "no_prefill_pool"
               for turns in finals.values() for f in turns)
    leak_check(colocated)


def _router_sees(cluster, worker_id: str, running: int) -> None:
    deadline = time.monotonic() + 30
    with Client(cluster.router, timeout=10) as c:
        while time.monotonic() < deadline:
            w = next(w for w in c.list_workers() if w["worker_id"] == worker_id)
            if int(w["stats"].get("num_running", 0)) >= running:
                return
            time.sleep(0.1)
    raise AssertionError(f"the router never saw {running} requests on {worker_id}")


def test_session_past_the_load_bound_moves_once_then_stays(disagg) -> None:
    finals, hist = converse(disagg.router, ["bound"], by="field", seed=99, turns=2)
    bound = finals["bound"][0]["decode_worker"]
    handle = next(h for h in disagg.workers if h.worker_id == bound)
    held = [f"hold-{i}" for i in range(6)]  # another router's requests: 6 > (1 + 1) x (0 + 1) and >= 4
    with grpc.insecure_channel(handle.address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for i, rid in enumerate(held):
            stub.Allocate(decode_pb2.AllocateRequest(
                request_id=rid, prompt_ids=[5 + i] * 20, lease_ms=60_000,
                sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=10)
        try:
            _router_sees(disagg, bound, len(held))
            more, hist = converse(disagg.router, ["bound"], by="field", seed=100, turns=2, history=hist)
        finally:
            for rid in held:
                stub.Release(decode_pb2.ReleaseRequest(request_id=rid), timeout=10)
    moved, after = more["bound"]
    assert moved["session_moved"] and moved["decode_worker"] != bound, moved
    assert moved["moved_from"].endswith("/" + bound), moved
    assert moved["move_reason"].startswith(f"{bound} overloaded ("), moved
    assert after["session_hit"] and not after["session_moved"]
    assert after["decode_worker"] == moved["decode_worker"]
    assert after["kv_blocks_reused"] > 0
    last, _ = converse(disagg.router, ["bound"], by="field", seed=101, turns=1, history=hist)
    assert last["bound"][0]["decode_worker"] == moved["decode_worker"] and last["bound"][0]["session_hit"]
    m = scrape(disagg.metrics_port)
    assert m['pdserve_router_session_moves_total{reason="overloaded"}'] == 1
    leak_check(disagg)
