"""router.prefill_load: the prefill queue estimate and the decode worker's local-prefill budget."""

import math

import pytest
from fake_clock import Clock

from router.prefill_load import LocalBudget, PrefillQueue


def test_queue_counts_outstanding_tokens_per_worker_until_answered():
    q = PrefillQueue(10_000.0, clock=Clock())
    a, b = q.begin("p0", 4096), q.begin("p0", 1000)
    c = q.begin("p1", 500)
    assert q.outstanding("p0") == 5096 and q.outstanding("p1") == 500
    assert q.wait_s("p0") == pytest.approx(0.5096)  # the default rate until one is learned
    q.end(a)
    q.end(a)  # idempotent: a finally may end it again
    assert q.outstanding("p0") == 1000
    q.end(b)
    q.end(c)
    assert q.outstanding("p0") == q.outstanding("p1") == 0 and q.wait_s("p0") == 0.0
    assert q.outstanding("unknown") == 0


def test_rate_is_learned_per_worker_as_a_decaying_best():
    clock = Clock()
    q = PrefillQueue(10_000.0, decay_per_s=0.1, clock=clock)
    q.end(q.begin("p0", 4096), compute_s=0.1, computed_tokens=4096)  # 40960 tok/s
    assert q.rate("p0") == pytest.approx(40960.0) and q.rate("p1") == 10_000.0
    # two prompts batched in one step each report the step's time: half the rate, not taken
    q.end(q.begin("p0", 4096), compute_s=0.2, computed_tokens=4096)
    assert q.rate("p0") == pytest.approx(40960.0)
    clock.t += 10.0  # older samples count less: e^-1 after 10 s at 0.1/s
    assert q.rate("p0") == pytest.approx(40960.0 * math.exp(-1.0))
    q.end(q.begin("p0", 4096), compute_s=0.2, computed_tokens=4096)  # now the newer, slower rate wins
    assert q.rate("p0") == pytest.approx(20480.0)
    q.end(q.begin("p0", 10), compute_s=0.0, computed_tokens=10)  # no compute time: no sample
    assert q.rate("p0") == pytest.approx(20480.0)
    with pytest.raises(ValueError):
        PrefillQueue(0.0)


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
