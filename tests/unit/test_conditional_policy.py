"""The router's feed into ``decide`` (``router.conditional.PrefillModePolicy``), without processes.

What it takes, all from the placer's worker view and cost model (the ones placement scores with):
the decode worker's reported KV size (so the transfer estimate uses the real model, not the
llama3-8b prior), its load and batch capacity, a link's bandwidth once that link was measured, the
prompts queued ahead on the prefill worker (this router's open placements) and their learned rate;
every decision is counted by mode and reason on the placer's registry, and a local one moves the
prompt's place in the queues from the prefill worker to the decode worker.
"""

from __future__ import annotations

import pytest
from fake_clock import Clock

from bench.placement_fakes import request
from router.conditional import ConditionalConfig, Paths, PrefillModePolicy, decide
from router.costs import CostConfig
from router.placement import Outcome, Placer, PlacerConfig, WorkerInfo, WorkerLoad

KV_PER_BLOCK = 16 * 4096  # 4 KiB per token


def make_placer(*, prefill_pool: bool = True, rate: float = 1e5, latency: float = 0.0) -> Placer:
    clock = Clock()
    costs = CostConfig(prefill_tokens_per_s=rate, transfer_latency_s=latency, bandwidth_ewma_alpha=1.0,
                       min_bandwidth_sample_bytes=1, attention_s_per_token_pair=0.0)
    placer = Placer(PlacerConfig(prefill_pool=prefill_pool, costs=costs), clock=clock, wall=clock)
    infos = [WorkerInfo(f"d{i}", "decode", "x", "i1", kv_bytes_per_block=KV_PER_BLOCK, block_size=16,
                        max_num_seqs=8) for i in range(3)]
    if prefill_pool:
        infos.append(WorkerInfo("p", "prefill", "y", "i1"))
    placer.update_workers(infos)
    return placer


def count(placer: Placer, mode: str, reason: str) -> float:
    v = placer.metrics.registry.get_sample_value("pdserve_router_prefill_decisions_total",
                                                 {"mode": mode, "reason": reason})
    return v or 0.0


def tokens(rid: str, n: int) -> list[int]:
    """A prompt no other request shares a block with."""
    seed = int.from_bytes(rid.encode(), "little")
    return [(seed * 7919 + i * 31) % 32000 for i in range(n)]


def place(placer: Placer, rid: str, n: int, decode: str = "d0"):
    others = {w for w in ("d0", "d1", "d2") if w != decode}
    return placer.place(request(rid, tokens(rid, n)), exclude=others)


def test_uses_reported_kv_size_load_and_only_a_measured_link() -> None:
    placer = make_placer()
    cfg = ConditionalConfig(min_uncached_tokens=16)
    pol = PrefillModePolicy(cfg, placer)
    placer.update_load("d0", WorkerLoad(num_running=4, incarnation="i1"))
    pl = place(placer, "a", 1000)
    got = pol.decide("a", 1000, 200, pl)
    want = decide(Paths(uncached_tokens=800, local_s=800 / 1e5, remote_s=1000 / 1e5,
                        transfer_s=800 * 4096 / 25e9, decode_running=5, decode_capacity=8), cfg)
    assert got == pytest.approx(want) and got.reason == "disaggregate"  # 3.2 MB at 25 GB/s << 8 ms
    # a measured slow link (1 MB/s) makes moving 3.2 MB slower than recomputing it
    placer.on_result(request("a", tokens("a", 1000)), pl,
                     Outcome(success=True, bytes_sent=1_000_000, transfer_s=1.0, blocks_sent=10))
    pl = place(placer, "b", 1000)
    slow = pol.decide("b", 1000, 200, pl)
    assert (slow.local, slow.reason) == (True, "transfer_slower") and slow.transfer_s > 3.0
    assert placer.view.outstanding_tokens("p") == 0 and placer.view.outstanding_tokens("d0") == 800
    placer.prefill_done("b")
    placer.forget_request("b")
    assert count(placer, "remote", "disaggregate") == 1 and count(placer, "local", "transfer_slower") == 1
    assert placer.inflight_total == 0 and placer.view.outstanding_tokens("d0") == 0


def test_threshold_disabled_and_no_prefill_pool() -> None:
    placer = make_placer()
    short = PrefillModePolicy(ConditionalConfig(min_uncached_tokens=64), placer).decide(
        "a", 100, 48, place(placer, "a", 100))
    assert (short.local, short.reason, short.uncached_tokens) == (True, "short_suffix", 52)
    off = PrefillModePolicy(None, placer).decide("b", 3, 0, place(placer, "b", 3))
    assert (off.local, off.reason) == (False, "disabled")
    alone = make_placer(prefill_pool=False)
    pl = place(alone, "c", 3)
    assert pl.prefill is None
    col = PrefillModePolicy(None, alone).decide("c", 3, 2, pl)
    assert (col.local, col.reason, col.uncached_tokens) == (True, "no_prefill_pool", 1)
    assert [count(placer, *k) for k in (("local", "short_suffix"), ("remote", "disabled"))] == [1, 1]
    assert count(alone, "local", "no_prefill_pool") == 1


def test_second_policy_on_one_registry_shares_the_counter() -> None:
    placer = make_placer()
    a, b = PrefillModePolicy(None, placer), PrefillModePolicy(None, placer)
    assert a.counter is b.counter is placer.metrics.prefill_decisions


def test_prefill_queue_and_local_budget() -> None:
    placer = make_placer(rate=10_000.0, latency=0.003)
    cfg = ConditionalConfig(min_uncached_tokens=16, max_prefill_wait_s=0.5, local_duty=0.01,
                            local_burst_s=0.5, max_local_stall_s=1.0, stall_weight=0.0)
    pol = PrefillModePolicy(cfg, placer)
    assert pol.decide("r0", 4096, 0, place(placer, "r0", 4096)).reason == "disaggregate"
    q1, q2 = place(placer, "q1", 4096), place(placer, "q2", 4096)  # 8192 more tokens queued at 10k tok/s
    busy = pol.decide("r1", 4096, 0, place(placer, "r1", 4096))
    assert (busy.local, busy.reason) == (True, "prefill_busy")
    assert busy.prefill_wait_s == pytest.approx((4096 * 3) / 10_000)
    # that local prefill (0.41 s) spent d0's budget: the next prompt queues at the prefill worker
    assert pol.decide("r2", 4096, 0, place(placer, "r2", 4096)).reason == "local_budget"
    # per worker
    assert pol.decide("r3", 4096, 0, place(placer, "r3", 4096, decode="d1")).reason == "prefill_busy"
    # answers end the queue; a learned rate (40k tok/s) shortens the estimate for the next burst
    for rid in ("r0", "q1", "q2", "r2"):
        placer.prefill_done(rid, worker_id="p", computed_tokens=4096, compute_s=0.1)
        placer.forget_request(rid)
    assert placer.view.outstanding_tokens("p") == 0
    assert placer.costs.prefill_rate("p") == pytest.approx(40960.0)
    place(placer, "q3", 8192)
    assert pol.decide("r4", 4096, 0, place(placer, "r4", 4096, decode="d2")).reason == "disaggregate"
    assert count(placer, "local", "prefill_busy") == 2 and count(placer, "remote", "local_budget") == 1
    for rid in ("r1", "r3", "q3", "r4"):
        placer.forget_request(rid)
    assert placer.inflight_total == 0
    assert not any(placer.view.outstanding_tokens(w) for w in placer.view.workers)
    del q1, q2


def test_streams_on_the_decode_worker_cap_a_local_prefill() -> None:
    # The view's placements on a decode worker, besides the request itself, are the streams a local
    # prefill would stall: 2048 tokens at 10k tok/s (0.2 s) is over the 50 ms cap where one runs.
    placer = make_placer(rate=10_000.0, latency=0.003)
    pol = PrefillModePolicy(ConditionalConfig(min_uncached_tokens=16, max_prefill_wait_s=0.5, local_duty=1.0),
                            placer)
    place(placer, "q", 8192, decode="d1")  # a queue at the prefill worker, and a stream on d1
    alone = pol.decide("a", 2048, 0, place(placer, "a", 2048, decode="d0"))
    assert (alone.local, alone.reason) == (True, "prefill_busy")
    shared = pol.decide("b", 2048, 0, place(placer, "b", 2048, decode="d1"))
    assert (shared.local, shared.reason) == (False, "decode_stall")
    assert count(placer, "remote", "decode_stall") == 1
    for rid in ("q", "a", "b"):
        placer.forget_request(rid)
    assert placer.inflight_total == 0
    assert not any(placer.view.outstanding_tokens(w) for w in placer.view.workers)
