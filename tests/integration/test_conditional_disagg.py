"""Conditional disaggregation with real processes: 1 prefill + 1 decode, router `--conditional-disagg auto`.

The decode worker's assumed prefill rate is set low (``--local-prefill-tokens-per-s 100``, the cost
model's prior for every worker until its own rate is learned, and the decode worker never learns
one here: recomputing 33 tokens looks slower than any transfer of them, while the router's wait
estimate for a concurrent batch stays far inside the request deadline, so admission control refuses
nothing), the load rule is off (``--max-prefill-wait-s 0``) and
the local budget unlimited (``--local-prefill-duty 1``), so the only rule that fires is the threshold
(``--min-uncached-tokens 32``): a prompt whose uncached part is <= 32 tokens is prefilled by the
decode worker, anything longer by the prefill worker. Covers: a concurrent mixed batch (some local,
some remote) token-identical to one engine, the decision reported per request and counted in the
router's metrics, a session's next turn going local because the decode worker holds the history,
seeded sampling, and cleanup on every local path (client cancel, deadline, a local request the
worker side aborts, a dropped or unknown local Decode). Every test ends with the leak checks: free
blocks back on both workers, nothing leased or running, the router's in-flight gauge at 0.

A second cluster (``busy_cluster``) turns the load rule on, with a queue threshold of a microsecond
and a budget of one local prefill: a concurrent burst of prompts is split between the prefill pool
and the decode worker ("prefill_busy") until the budget is spent ("local_budget"), token-identical
to one engine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import grpc
import pytest
from test_cluster_1p1d import reference, run_concurrently

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port
from pdserve.probe import scrape_metrics as scrape
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
THRESHOLD = 32


@contextlib.contextmanager
def metered_cluster(model, run_dir, *, router_args=(), **kw):
    """A LocalCluster (session+prefix) whose router serves metrics; records the starting free blocks
    that ``wait_clean`` checks against."""
    port = free_port()
    with LocalCluster(model, run_dir=run_dir, policy="session+prefix",
                      router_args=(*router_args, "--metrics-port", str(port)), **kw) as c:
        c.model, c.metrics_port = model, port
        c.start_free = c.free_blocks()
        yield c


def wait_clean(cluster, port: int) -> None:
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free
    assert all(s.num_leased == 0 and s.num_running == 0 for s in stats.values())
    deadline = time.monotonic() + 10
    while scrape(port)["pdserve_router_inflight_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(port)["pdserve_router_inflight_requests"] == 0


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    args = ("--conditional-disagg", "auto", "--min-uncached-tokens", str(THRESHOLD),
            "--local-prefill-tokens-per-s", "100", "--max-prefill-wait-s", "0", "--local-prefill-duty", "1")
    with metered_cluster(make_checkpoint("llama"), tmp_path_factory.mktemp("cond"), prefill=1, decode=1,
                         transport="tcp", router_args=args) as c:
        yield c


@pytest.fixture
def clean(cluster):
    yield
    wait_clean(cluster, cluster.metrics_port)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 5 for i in range(n)]


def test_mixed_batch_local_and_remote_equal_one_engine(cluster, clean) -> None:
    lens = [3, 20, 32, 33, 60, 120]
    max_tokens = [6, 9, 4, 7, 12, 5]
    ps = [ids(100 + n, n) for n in lens]
    want = reference(cluster.model, ps, max_tokens)
    got = run_concurrently(cluster.router, ps, max_tokens, ignore_eos=True)
    for n, r, w in zip(lens, got, want, strict=True):
        f = r.final
        assert r.token_ids == w, f"prompt of {n} tokens ({f['prefill_mode']})"
        assert f["usage"]["completion_tokens"] == len(w)
        if n <= THRESHOLD:
            assert (f["prefill_mode"], f["prefill_mode_reason"], f["transport"]) == ("local", "short_suffix",
                                                                                     "local")
            assert f["prefill_worker"] == f["decode_worker"] and f["kv_blocks_sent"] == 0
        else:
            assert (f["prefill_mode"], f["prefill_mode_reason"], f["transport"]) == ("remote", "disaggregate",
                                                                                     "tcp")
            assert f["prefill_worker"].startswith("prefill") and f["kv_blocks_sent"] == -(-n // 16)
    m = scrape(cluster.metrics_port)
    local = m['pdserve_router_prefill_decisions_total{mode="local",reason="short_suffix"}']
    remote = m['pdserve_router_prefill_decisions_total{mode="remote",reason="disaggregate"}']
    assert local >= 3 and remote >= 3


def test_next_turn_prefills_on_the_decode_worker_that_holds_the_history(cluster, clean) -> None:
    turn1 = ids(7, 90)
    with Client(cluster.router, timeout=120) as c:
        first = c.generate(prompt_ids=turn1, max_tokens=10, ignore_eos=True, session_id="chat")
        turn2 = turn1 + first.token_ids + ids(8, 12)
        second = c.generate(prompt_ids=turn2, max_tokens=10, ignore_eos=True, session_id="chat")
    assert first.final["prefill_mode"] == "remote"
    f = second.final
    # 90 + 10 - 1 tokens of KV on the decode worker: 6 full blocks; 112 - 96 = 16 uncached tokens
    assert (f["prefill_mode"], f["prefill_mode_reason"]) == ("local", "short_suffix")
    assert f["decode_worker"] == first.final["decode_worker"] and f["kv_blocks_reused"] == 6
    assert f["usage"]["cached_tokens"] == 96 and f["kv_blocks_sent"] == 0
    assert second.token_ids == reference(cluster.model, [turn2], [10])[0]


def test_seeded_sampling_local_equals_one_engine(cluster, clean) -> None:
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    prompt = ids(9, 24)
    with Client(cluster.router, timeout=60) as c:
        got = c.generate(prompt_ids=prompt, max_tokens=12, temperature=0.9, seed=1234, ignore_eos=True)
    assert got.final["prefill_mode"] == "local"
    engine = LLMEngine(EngineConfig(model=str(cluster.model), num_blocks=64, device="cpu"))
    want = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, seed=1234,
                                                    ignore_eos=True))[0]
    assert got.token_ids == want


def test_cancel_and_deadline_while_local(cluster, clean) -> None:
    with Client(cluster.router, timeout=120) as c:
        call = c.stream(prompt_ids=ids(11, 20), max_tokens=400, ignore_eos=True)
        first = next(call)
        assert len(first.token_ids) == 1  # token 1 of a local prefill streams on its own
        call.cancel()
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt_ids=ids(12, 30), max_tokens=400, ignore_eos=True, timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_decode_worker_errors_on_the_local_path_free_the_reservation(cluster, clean) -> None:
    decode = next(h for h in cluster.workers if h.role == "decode")
    with grpc.insecure_channel(decode.address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        # Allocate, then the stream is dropped before the local prefill produced anything (if the
        # cancel beats the Decode handler, the short lease is what frees the reservation).
        stub.Allocate(decode_pb2.AllocateRequest(request_id="gone-early", prompt_ids=ids(13, 40),
                                                 sampling=common_pb2.SamplingParams(max_tokens=50),
                                                 lease_ms=2_000), timeout=10)
        call = stub.Decode(decode_pb2.DecodeRequest(request_id="gone-early", prefill_locally=True),
                           timeout=30)
        call.cancel()
        # A local Decode for a reservation that does not exist: NOT_FOUND, nothing held.
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Decode(decode_pb2.DecodeRequest(request_id="never", prefill_locally=True), timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # Aborted by the worker side while it generates (Release/Abort from a router that gave
        # up): the stream ends, the reservation-turned-request is freed. The whole context's worth
        # of tokens: with 400, a test process starved on a loaded machine found the request already
        # finished when it sent the Release (found=False).
        stub.Allocate(decode_pb2.AllocateRequest(request_id="aborted", prompt_ids=ids(14, 20),
                                                 sampling=common_pb2.SamplingParams(max_tokens=2048 - 20,
                                                                                    ignore_eos=True),
                                                 lease_ms=30_000), timeout=10)
        stream = stub.Decode(decode_pb2.DecodeRequest(request_id="aborted", prefill_locally=True), timeout=60)
        first = next(stream)
        assert len(first.token_ids) >= 1 and first.completion_tokens == len(first.token_ids)
        assert stub.Release(decode_pb2.ReleaseRequest(request_id="aborted"), timeout=10).found
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"
        stats = stub.GetStats(common_pb2.StatsRequest(), timeout=10)
        assert stats.kv_bytes_per_block > 0 and stats.max_num_seqs > 0


@pytest.fixture(scope="module")
def busy_cluster(make_checkpoint, tmp_path_factory):
    # Any token in flight at the prefill worker counts as a queue (1 us). An assumed rate of 1000 tok/s
    # makes a 60-token prompt cost 60 ms locally (more than the 3 ms transfer: no "transfer_slower") and
    # the budget (100 ms at once, refilled at 0.1% of the time) one local prefill for the whole burst.
    args = ("--conditional-disagg", "auto", "--min-uncached-tokens", "0", "--max-prefill-wait-s", "1e-6",
            "--local-prefill-tokens-per-s", "1000", "--local-prefill-duty", "0.001",
            "--local-prefill-burst-s", "0.1", "--local-prefill-max-stall-s", "1",
            "--local-prefill-stall-weight", "0")
    with metered_cluster(make_checkpoint("llama"), tmp_path_factory.mktemp("busy"), prefill=1, decode=1,
                         transport="tcp", router_args=args) as c:
        yield c


def placed_together(cluster, port: int, fire, n: int):
    """Run fire() (which sends n requests at once and returns their results) with the decode worker
    stopped (SIGSTOP) until the router has placed all n, so every one is placed, and queued at the
    prefill worker, before any is decided (a decision follows the decode worker's Allocate). Resumed
    after at most 1.5 s either way: the router's stats poll gives up on a silent worker after 2 s."""
    decode = next(h for h in cluster.workers if h.role == "decode")
    box: list = []
    runner = threading.Thread(target=lambda: box.append(fire()))
    os.kill(decode.pid, signal.SIGSTOP)
    try:
        runner.start()
        deadline = time.monotonic() + 1.5
        while scrape(port)["pdserve_router_inflight_requests"] < n and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    runner.join(180)
    return box[0]


def test_prefill_queue_sends_some_prompts_local_within_the_budget(busy_cluster) -> None:
    c = busy_cluster
    ps = [ids(200 + i, 60) for i in range(8)]
    max_tokens = [5] * len(ps)
    want = reference(c.model, ps, max_tokens)
    # A burst whose prompts all meet in the prefill queue: without holding them, a slow client can send
    # them one after the other, each done before the next is decided, and none sees a queue.
    burst = lambda: run_concurrently(c.router, ps, max_tokens, ignore_eos=True)  # noqa: E731
    got = placed_together(c, c.metrics_port, burst, len(ps))
    reasons = [r.final["prefill_mode_reason"] for r in got]
    for r, w in zip(got, want, strict=True):
        assert r.token_ids == w, r.final["prefill_mode_reason"]
        mode = "local" if r.final["prefill_mode_reason"] == "prefill_busy" else "remote"
        assert r.final["prefill_mode"] == mode
    assert set(reasons) <= {"disaggregate", "prefill_busy", "local_budget"}, reasons
    # A queue was seen and the budget held: a prompt is queued at the prefill worker from its placement,
    # so the first prompt decided sees the others and goes local; the budget allows one, so the rest go
    # to the prefill pool, as "disaggregate" or "local_budget".
    assert reasons.count("prefill_busy") == 1, reasons
    m = scrape(c.metrics_port)
    assert m['pdserve_router_prefill_decisions_total{mode="local",reason="prefill_busy"}'] == reasons.count(
        "prefill_busy")
    # one at a time, nothing is ever queued: every prompt goes to the prefill pool
    with Client(c.router, timeout=60) as cl:
        alone = [cl.generate(prompt_ids=ids(300 + i, 60), max_tokens=3).final for i in range(2)]
    assert [f["prefill_mode_reason"] for f in alone] == ["disaggregate"] * 2
    wait_clean(c, c.metrics_port)
