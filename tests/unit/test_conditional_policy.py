"""The router's feed into ``decide`` (``router.conditional.PrefillModePolicy``), without processes.

What it takes from the placed pair: the decode worker's reported KV bytes per block (so the transfer
estimate uses the real model, not the llama3-8b default), its load and batch capacity, and the
placer's link bandwidth only once that pair was measured; every decision is counted by mode and
reason on the placer's registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from pdserve.v1 import common_pb2
from router.conditional import ConditionalConfig, PrefillModePolicy, decide
from router.placement import Placer, PlacerConfig


@dataclass
class Handle:
    worker_id: str
    stats: common_pb2.WorkerStats | None = None


@dataclass
class Req:
    prompt_ids: list[int]


def make_placer() -> Placer:  # a real Placer: its metrics registry and link stats
    return Placer(PlacerConfig(bandwidth_ewma_alpha=1.0, min_bandwidth_sample_bytes=1))


def stats(**kw) -> common_pb2.WorkerStats:
    base = dict(worker_id="d", block_size=16, kv_bytes_per_block=16 * 4096, num_running=0, max_num_seqs=8)
    return common_pb2.WorkerStats(**{**base, **kw})


def count(placer: Placer, mode: str, reason: str) -> float:
    v = placer.metrics.registry.get_sample_value("pdserve_router_prefill_decisions_total",
                                                 {"mode": mode, "reason": reason})
    return v or 0.0


def test_uses_reported_kv_size_load_and_only_a_measured_link() -> None:
    placer = make_placer()
    cfg = ConditionalConfig(min_uncached_tokens=16, local_prefill_tokens_per_s=1e5, transfer_latency_s=0.0)
    pol = PrefillModePolicy(cfg, placer)
    p, d = Handle("p"), Handle("d", stats(num_running=4))
    req = Req(list(range(1000)))
    got = pol.decide(req, 200, p, d)
    want = decide(prompt_tokens=1000, cached_tokens=200, link_gbps=None, decode_running=4, decode_capacity=8,
                  config=ConditionalConfig(min_uncached_tokens=16, local_prefill_tokens_per_s=1e5,
                                           transfer_latency_s=0.0, kv_bytes_per_token=4096))
    assert got == want and got.reason == "disaggregate"  # 800 x 4 KiB at 25 GB/s << 8 ms of prefill
    # a measured slow link (1 MB/s) makes moving 3.2 MB slower than recomputing it
    placer.links.observe("p", "d", bytes_sent=1_000_000, seconds=1.0, blocks_sent=10)
    slow = pol.decide(req, 200, p, d)
    assert (slow.local, slow.reason) == (True, "transfer_slower")
    assert slow.transfer_s > 3.0
    assert count(placer, "remote", "disaggregate") == 1 and count(placer, "local", "transfer_slower") == 1


def test_threshold_disabled_and_colocated() -> None:
    placer = make_placer()
    short = PrefillModePolicy(ConditionalConfig(min_uncached_tokens=64), placer).decide(
        Req(list(range(100))), 48, Handle("p"), Handle("d", stats()))
    assert (short.local, short.reason, short.uncached_tokens) == (True, "short_suffix", 52)
    off = PrefillModePolicy(None, placer).decide(Req([1, 2, 3]), 0, Handle("p"), Handle("d", None))
    assert (off.local, off.reason) == (False, "disabled")
    col = PrefillModePolicy(None, placer, colocated=True).decide(Req([1, 2, 3]), 2, None, Handle("d"))
    assert (col.local, col.reason, col.uncached_tokens) == (True, "colocated", 1)
    assert [count(placer, *k) for k in (("local", "short_suffix"), ("remote", "disabled"),
                                        ("local", "colocated"))] == [1, 1, 1]


def test_second_policy_on_one_registry_shares_the_counter() -> None:
    placer = make_placer()
    a, b = PrefillModePolicy(None, placer), PrefillModePolicy(None, placer)
    assert a.counter is b.counter
    assert PrefillModePolicy(None, object()).counter is None  # a placer without metrics: not counted
    assert isinstance(placer.metrics.registry, CollectorRegistry)


def test_prefill_queue_and_local_budget() -> None:
    placer = make_placer()
    cfg = ConditionalConfig(min_uncached_tokens=16, local_prefill_tokens_per_s=10_000.0,
                            max_prefill_wait_s=0.5, local_duty=0.01, local_burst_s=0.5)
    pol = PrefillModePolicy(cfg, placer)
    p, d = Handle("p"), Handle("d", stats())
    req = Req(list(range(4096)))
    assert pol.decide(req, 0, p, d).reason == "disaggregate"
    tickets = [pol.prefill_sent("p", 4096) for _ in range(2)]  # 8192 tokens queued: 0.82 s at 10k tok/s
    busy = pol.decide(req, 0, p, d)
    assert (busy.local, busy.reason) == (True, "prefill_busy")
    assert busy.prefill_wait_s == pytest.approx(0.8192)
    # that local prefill (0.41 s) spent the budget: the next prompt queues at the prefill worker
    assert pol.decide(req, 0, p, d).reason == "local_budget"
    assert pol.decide(req, 0, p, Handle("d2", stats(worker_id="d2"))).reason == "prefill_busy"  # per worker
    # answers end the queue; a learned rate (40k tok/s) shortens the estimate for the next burst
    pol.prefill_answered(tickets[0], compute_s=0.1, computed_tokens=4096)
    pol.prefill_answered(tickets[1])
    assert pol.queue.outstanding("p") == 0 and pol.queue.rate("p") == pytest.approx(40960.0, rel=1e-3)
    pol.prefill_sent("p", 8192)
    assert pol.decide(req, 0, p, Handle("d3", stats())).reason == "disaggregate"  # 0.2 s: no queue to flee
    assert count(placer, "local", "prefill_busy") == 2 and count(placer, "remote", "local_budget") == 1
