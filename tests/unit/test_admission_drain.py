"""Admission past a slow KV link: the drain term keeps admitted requests within their budget.

A discrete-event simulation of one prefill worker that computes fast and pushes its KV over a link
slower than the arrivals (the TCP fallback past its capacity), driven through the real Placer (its
worker view and cost model) and ``Admission``: every arriving prompt is placed, checked against a
1.5 s budget, and either refused (its placement closed, as the pipeline does) or queued for the
compute (FIFO) and then the link (FIFO). Each answer reports its compute time and push wait at its
simulated time, as a ``PrefillResponse`` does, and the cost model learns from it.

With the drain term the admitted requests' wait for the first token stays near the budget while the
link serves as many prompts as it can carry; with only the compute queue and the push wait's average
(``--admission-drain off``) the backlog on the link grows and the admitted requests' wait with it.
With the drain wait in the push wait's place (``replace``) the link is as busy and the admitted wait
as bounded.
Below the link's capacity neither refuses anything. Ends with the leak checks: no placement open, no
token queued.
"""

from __future__ import annotations

import heapq

from fake_clock import Clock

from bench.placement_fakes import request
from router.costs import CostConfig
from router.placement import Placer, PlacerConfig, WorkerInfo
from router.shedding import DRAIN_MODES, Admission, AdmissionConfig, Refused

COMPUTE = 40_000.0     # tokens/s
LINK = 10_000.0        # tokens/s of KV the link carries: the bottleneck
TOKENS = 2_000
BUDGET = 1.5
DURATION = 30.0


def simulate(rate: float, drain: str) -> tuple[list[float], int, Placer]:
    """Per admitted request its wait for the first token; how many were refused; the placer."""
    clock = Clock(0.0)
    costs = CostConfig(prefill_tokens_per_s=COMPUTE, attention_s_per_token_pair=0.0)
    placer = Placer(PlacerConfig(costs=costs), clock=clock, wall=clock)
    placer.update_workers([WorkerInfo("p", "prefill", "a", "i1"), WorkerInfo("d", "decode", "b", "i1")])
    admission = Admission(AdmissionConfig(max_queue_wait_s=BUDGET, drain=drain), placer, clock=clock)
    events: list[tuple[float, int, str, float]] = []  # (answer time, seq, request id, push wait)
    compute_free = link_free = 0.0
    waits: list[float] = []
    refused = 0

    def run_until(t: float) -> None:
        while events and events[0][0] <= t:
            when, _, rid, push_wait = heapq.heappop(events)
            clock.t = when
            placer.prefill_done(rid, worker_id="p", computed_tokens=TOKENS, compute_s=TOKENS / COMPUTE,
                                push_wait_s=push_wait)
            placer.forget_request(rid)  # decoded elsewhere; its end does not matter here

    n = int(DURATION * rate)
    for i in range(n):
        now = i / rate
        run_until(now)
        clock.t = now
        rid = f"r{i}"
        pl = placer.place(request(rid, [(i * 7919 + j * 31) % 32000 for j in range(TOKENS)]))
        try:
            admission.check(rid, pl, None)
        except Refused:
            refused += 1
            placer.forget_request(rid)
            continue
        compute_free = max(now, compute_free) + TOKENS / COMPUTE
        link_free = max(compute_free, link_free) + TOKENS / LINK
        waits.append(link_free - now)
        heapq.heappush(events, (link_free, i, rid, link_free - compute_free))
    run_until(float("inf"))
    return waits, refused, placer


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))]


def leak_free(placer: Placer) -> None:
    assert placer.view.open_total == 0
    assert placer.view.outstanding_tokens("p") == 0 and placer.view.inflight("p") == 0


def test_below_the_links_capacity_nothing_is_refused_either_way():
    for drain in DRAIN_MODES:
        waits, refused, placer = simulate(rate=3.0, drain=drain)  # 6k tokens/s on a 10k/s link
        assert refused == 0 and max(waits) < BUDGET
        leak_free(placer)


def test_past_the_links_capacity_the_drain_term_keeps_the_admitted_within_budget():
    with_drain, refused, placer = simulate(rate=8.0, drain="on")  # 16k tokens/s on a 10k/s link
    leak_free(placer)
    without, _, placer_without = simulate(rate=8.0, drain="off")
    leak_free(placer_without)
    # The link serves what it can: at least 85% of its capacity over the run is admitted ...
    capacity = DURATION * LINK / TOKENS
    assert len(with_drain) >= 0.85 * capacity
    # ... and the admitted wait about their budget plus their own push, never the growing backlog.
    own = TOKENS / COMPUTE + TOKENS / LINK
    assert p90(with_drain) <= BUDGET + own
    assert max(with_drain) <= BUDGET + 2 * own
    assert refused > 0
    # Without it the estimate trails the link's backlog: admitted requests wait past the budget.
    assert p90(without) > BUDGET + own


def test_the_drain_wait_in_place_of_the_push_wait_protects_as_well():
    """``replace``: past the link's capacity it admits at least as many as ``on``, within the same
    bound on their wait."""
    replaced, refused, placer = simulate(rate=8.0, drain="replace")
    leak_free(placer)
    on, _, _ = simulate(rate=8.0, drain="on")
    own = TOKENS / COMPUTE + TOKENS / LINK
    assert refused > 0 and len(replaced) >= len(on)
    assert p90(replaced) <= BUDGET + own and max(replaced) <= BUDGET + 2 * own
