"""The router's queue estimates (router/state/workers.py), the learned rates (router/costs.py) and the
decode worker's local-prefill budget (router/prefill_load.py)."""

import math

import pytest
from fake_clock import Clock

from router.costs import CostConfig, CostModel
from router.placement import WorkerInfo
from router.prefill_load import LocalBudget
from router.state.workers import WorkerView


def view() -> WorkerView:
    v = WorkerView(unhealthy_cooldown_s=1.0, load_stale_s=5.0, clock=Clock(), wall=Clock())
    v.update([WorkerInfo("p0", "prefill", "a"), WorkerInfo("p1", "prefill", "b"),
              WorkerInfo("d0", "decode", "c")])
    return v


def test_queue_counts_outstanding_tokens_per_worker_until_answered():
    v = view()
    v.begin("a", "p0", "d0", 4096)
    v.begin("b", "p0", "d0", 1000)
    v.begin("c", "p1", "d0", 500)
    assert v.outstanding_tokens("p0") == 5096 and v.outstanding_tokens("p1") == 500
    assert (v.inflight("p0"), v.inflight("d0"), v.own_prefill_tokens("b")) == (2, 3, 1000)
    v.prefill_done("a")
    v.prefill_done("a")  # idempotent: a finally may end it again
    assert v.outstanding_tokens("p0") == 1000 and v.inflight("p0") == 1 and v.inflight("d0") == 3
    v.begin("b", "p1", "d0", 10)  # a retry replaces its predecessor
    assert v.outstanding_tokens("p0") == 0 and v.outstanding_tokens("p1") == 510
    v.move_prefill("c", "d0", 300)  # the decode worker computes it instead: its queue, not a 2nd request
    assert v.outstanding_tokens("p1") == 10 and v.outstanding_tokens("d0") == 300 and v.inflight("d0") == 3
    for rid in ("a", "b", "c", "c"):
        v.end(rid)
    assert v.open_total == 0 and not any(v.inflight(w) or v.outstanding_tokens(w) for w in v.workers)
    assert v.outstanding_tokens("unknown") == 0


def test_rate_is_learned_per_worker_as_a_decaying_best():
    clock = Clock()
    c = CostModel(CostConfig(prefill_tokens_per_s=10_000.0, rate_decay_per_s=0.1,
                             attention_s_per_token_pair=0.0), clock=clock)
    assert c.queue_s("p0", 5096) == pytest.approx(0.5096)  # the prior until one is learned
    c.observe_prefill("p0", tokens=4096, compute_s=0.1)  # 40960 tok/s
    assert c.prefill_rate("p0") == pytest.approx(40960.0) and c.prefill_rate("p1") == 10_000.0
    # two prompts batched in one step each report the step's time: half the rate, not taken
    c.observe_prefill("p0", tokens=4096, compute_s=0.2)
    assert c.prefill_rate("p0") == pytest.approx(40960.0)
    clock.t += 10.0  # older samples count less: e^-1 after 10 s at 0.1/s
    assert c.prefill_rate("p0") == pytest.approx(40960.0 * math.exp(-1.0))
    c.observe_prefill("p0", tokens=4096, compute_s=0.2)  # now the newer, slower rate wins
    assert c.prefill_rate("p0") == pytest.approx(20480.0)
    c.observe_prefill("p0", tokens=10, compute_s=0.0)  # no compute time: no sample
    assert c.prefill_rate("p0") == pytest.approx(20480.0)
    assert c.prefill_s("p0", 2048) == pytest.approx(0.1)
    c.forget("p0")  # a restarted worker starts from the prior again
    assert c.prefill_rate("p0") == 10_000.0
    with pytest.raises(ValueError):
        CostConfig(prefill_tokens_per_s=0.0)


def test_transfer_uses_the_reported_layout_and_the_measured_link():
    c = CostModel(CostConfig(default_bandwidth_Bps=1e9, transfer_latency_s=0.001, kv_bytes_per_token=1000,
                             bandwidth_ewma_alpha=1.0, min_bandwidth_sample_bytes=1), block_size=16)
    assert c.transfer_s("p", "d", 0) == 0.0
    assert c.transfer_s("p", "d", 1000) == pytest.approx(0.001 + 1e6 / 1e9)  # the prior: 1000 B/token
    c.set_layout("d", kv_bytes_per_block=16 * 4096, block_size=16)
    assert c.kv_bytes_per_token("d") == 4096
    c.observe_transfer("p", "d", bytes_sent=4_096_000, seconds=1.0, blocks_sent=62)  # 4.1 MB/s measured
    assert c.links.measured_from("p") and not c.links.measured_from("q")
    assert c.transfer_s("p", "d", 1000) == pytest.approx(0.001 + 1.0)
    assert c.transfer_s("q", "d", 1000) == pytest.approx(0.001 + 4096e3 / 1e9)  # another link: default


def test_budget_refills_at_duty_up_to_the_burst():
    clock = Clock()
    b = LocalBudget(duty=0.25, burst_s=0.5, clock=clock)
    assert b.available("d0") == 0.5
    b.take("d0", 0.4)
    b.take("d0", 0.3)  # one prompt may overdraw; the bucket is in debt
    assert b.available("d0") == pytest.approx(-0.2)
    assert b.available("d1") == 0.5  # per worker
    clock.t += 2.0
    assert b.available("d0") == pytest.approx(0.3)
    clock.t += 100.0
    assert b.available("d0") == pytest.approx(0.5)  # capped at the burst


def test_full_duty_is_unlimited_and_bad_values_are_refused():
    b = LocalBudget(duty=1.0, burst_s=0.0)
    b.take("d0", 100.0)
    assert b.unlimited and b.available("d0") == math.inf
    for duty, burst in ((0.0, 1.0), (1.5, 1.0), (0.5, -1.0)):
        with pytest.raises(ValueError):
            LocalBudget(duty=duty, burst_s=burst)


def test_queue_progress_counts_from_the_last_answer():
    clock = Clock()
    v = WorkerView(unhealthy_cooldown_s=1.0, load_stale_s=5.0, clock=clock, wall=clock)
    v.update([WorkerInfo("p0", "prefill", "a"), WorkerInfo("d0", "decode", "c")])
    c = CostModel(CostConfig(prefill_tokens_per_s=1000.0, attention_s_per_token_pair=0.0), clock=clock)
    v.begin("a", "p0", "d0", 1000)  # an idle worker starts on it at once
    v.begin("b", "p0", "d0", 1000)
    clock.t += 0.4
    assert c.queue_s("p0", v.outstanding_tokens("p0"), v.busy_for("p0")) == pytest.approx(1.6)
    v.move_prefill("b", "d0", 1000)  # leaving the tail says nothing about the head's progress
    assert c.queue_s("p0", v.outstanding_tokens("p0"), v.busy_for("p0")) == pytest.approx(0.6)
    v.begin("c", "p0", "d0", 500)
    clock.t += 0.6
    v.prefill_done("a", answered=True)  # answered: the worker starts on the next one now
    assert v.busy_for("p0") == 0.0 and v.outstanding_tokens("p0") == 500
    for rid in ("a", "b", "c"):
        v.end(rid)
    assert v.open_total == 0 and v.busy_for("p0") == 0.0 and v.busy_for("d0") == 0.0
