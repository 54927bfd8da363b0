"""The day-long planner simulation (bench/planner_day*.py) on a short, light trace: its bookkeeping, not
its timings. Requests are conserved (each served once, every worker empty at the end, the windows' counts
add up to the trace), GPU-hours are the replicas' time plus the drains', the real planner stays within its
bounds, and a seed gives the same day twice. The capacity model reproduces the measurements it is fitted
to."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from bench.planner_day import CONFIG, PLANNERS, Search, drive, fixed, planner_seeds
from bench.planner_day_model import RESULTS, STEP_AHEAD, Capacity, day_trace
from bench.planner_day_sim import Cluster
from pdserve.app.planner.capacity import CapacityModel
from pdserve.app.planner.policy import Planner

HOURS, PEAK, WINDOW = 1.0, 15.0, 20.0


@pytest.fixture(scope="module")
def cap() -> Capacity:
    return Capacity.measured()


@pytest.fixture(scope="module")
def trace():
    return day_trace(5, hours=HOURS, peak_rps=PEAK, warmup_s=600.0)


@pytest.fixture(scope="module")
def planned(cap, trace):
    return _planner_run(cap, trace)


def _planner_run(cap, trace, config=CONFIG, which="engine seed"):
    name, alpha = PLANNERS[which]
    cluster = Cluster(cap, trace, prefill=config.min_prefill, decode=config.min_decode, seed=5, window=WINDOW)
    model = CapacityModel(seed=planner_seeds()[name], alpha=alpha)
    planner = Planner(config, model, clock=lambda: cluster.now)
    seen = []
    result, changes = drive(cluster, planner, on_signals=seen.append)
    return cluster, result, changes, seen


def _drained(cluster: Cluster) -> None:
    """Every worker ends empty: no stream, queue, allocation or queued prompt left behind."""
    for w in cluster.all:
        assert (w.B, len(w.queue), w.leased, len(w.heap), w.kv) == (0, 0, 0, 0, 0), w.pool
        assert not w.starts or w.starts[-1] <= cluster.now
    assert not cluster.events


def test_capacity_reproduces_the_measurements(cap):
    assert cap.prefill_s(4096) == pytest.approx(0.10782, rel=1e-3)  # the roofline's 4096-token prefill
    assert cap.prefill_s(16384) / 16384 > cap.prefill_s(1024) / 1024  # attention makes long prompts dearer
    for row in json.loads((RESULTS / STEP_AHEAD).read_text())["decode"]:
        engine_ms = cap.tpot_s(row["batch"], row["batch"] * row["context"]) / cap.serving_factor * 1e3
        assert engine_ms == pytest.approx(row["ahead_ms"], abs=0.5)
    assert 1.0 < cap.serving_factor < 3.0 and cap.max_seqs == 64 and cap.kv_blocks > 30000


def test_fixed_pools_conserve_requests_and_count_gpu_hours(cap, trace):
    cluster = Cluster(cap, trace, prefill=2, decode=2, seed=5, window=WINDOW)
    r = cluster.run()
    assert len(r.ttft) == len(r.tpot) == len(trace) > 1000
    assert np.isfinite(r.ttft).all() and np.isfinite(r.tpot).all()
    assert (r.ttft > 0).all() and (r.tpot > 0).all()
    _drained(cluster)
    assert r.gpu_hours == pytest.approx(4 * HOURS)  # the warm-up counts for nothing
    assert r.actions == 0
    alone = Cluster(cap, trace, prefill=2, decode=0, seed=5, window=WINDOW).run()  # prefill only
    np.testing.assert_allclose(alone.ttft, r.ttft)  # TTFT does not depend on the decode pool
    assert (alone.tpot == 0).all()


def test_planner_conserves_requests_and_accounts_gpu_hours(planned, trace):
    cluster, r, changes, seen = planned
    assert np.isfinite(r.ttft).all() and np.isfinite(r.tpot).all()
    _drained(cluster)
    assert changes and r.actions == sum(c["outcome"] == "applied" for c in changes)
    # the windows' counters add up to the trace: every request placed once, in the window it arrived
    last = seen[-1].at
    assert sum(s.requests for s in seen) == int((trace.at < last).sum())
    assert sum(s.prompt_tokens for s in seen) == int(trace.prompt[trace.at < last].sum())
    assert [s.at for s in seen] == pytest.approx(trace.start + WINDOW * np.arange(1, len(seen) + 1))
    # GPU-hours: the replicas the actuator sees (provisioning counts), plus each drained worker's drain
    end, hours, t_prev, n_prev = trace.end, 0.0, trace.start, 0
    for t, p, d in r.timeline + [(end, 0, 0)]:
        lo, hi = max(t_prev, 0.0), min(t, end)
        hours += n_prev * max(hi - lo, 0.0)
        t_prev, n_prev = t, p + d
    drains = sum(max(min(w.died, end) - max(w.drain_from, 0.0), 0.0) for w in cluster.all
                 if w.drain_from is not None)
    assert r.gpu_hours == pytest.approx((hours + drains) / 3600.0)


def test_planner_stays_within_its_bounds(cap, trace):
    config = replace(CONFIG, min_prefill=2, max_prefill=3, min_decode=2, max_decode=3)
    _, r, changes, _ = _planner_run(cap, trace, config=config, which="profile seed")
    assert {c["to"] for c in changes} <= {2, 3}
    for _, p, d in r.timeline:
        assert 2 <= p <= 3 and 2 <= d <= 3
    assert 4 * HOURS <= r.gpu_hours <= 6 * HOURS + 0.5  # within the bounds (a drain may outlast a hand-back)


def test_a_seed_gives_the_same_day(cap, trace, planned):
    again = day_trace(5, hours=HOURS, peak_rps=PEAK, warmup_s=600.0)
    np.testing.assert_array_equal(again.at, trace.at)
    np.testing.assert_array_equal(again.answer, trace.answer)
    assert not np.array_equal(day_trace(6, hours=HOURS, peak_rps=PEAK, warmup_s=600.0).prompt[:100],
                              trace.prompt[:100])
    a, b = planned, _planner_run(cap, trace)
    assert a[1].gpu_hours == b[1].gpu_hours and a[2] == b[2]
    np.testing.assert_array_equal(a[1].ttft, b[1].ttft)
    np.testing.assert_array_equal(a[1].tpot, b[1].tpot)


def test_search_finds_the_smallest_fixed_allocation(monkeypatch):
    """With a made-up attainment table: the bounds by bisection, then the fewest GPUs reaching it."""

    def table(p: int, d: int) -> float:
        prefill_ok = min(1.0, p / 3)
        return prefill_ok if d == 0 else prefill_ok * min(1.0, d / 5) * (0.995 if p + d == 8 else 1.0)

    class Now:
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    class Pool:
        def submit(self, fn, seed, hours, p, d):
            assert fn is fixed
            return Now({"attainment": table(p, d), "prefill": p, "decode": d, "gpu_hours": (p + d) * hours})

    search = Search(1, 24.0, Pool())  # type: ignore[arg-type]
    assert search.bounds(0.99) == (3, 5)
    assert search.one_to_one(0.99) == 5
    best = search.best(0.99)
    assert (best["prefill"], best["decode"]) == (3, 5)
    assert math.isclose(best["attainment"], 0.995)
    assert (search.best(0.999)["prefill"], search.best(0.999)["decode"]) == (3, 6)  # 8 GPUs reach 99.5%
