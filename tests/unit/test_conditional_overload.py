"""Conditional disaggregation under a simulated overload never picks the worse path.

A discrete-event simulation of one prefill and one decode worker with known prefill rates, driven
through the real Placer (its worker view and cost model) and ``PrefillModePolicy``: prompts arrive
faster than the prefill worker computes them. The prefill worker's answers teach the cost model its
rate; the queues the decision sees are the router's own open placements, which the simulation keeps
exact by reporting every answer at its simulated time. For every prompt the simulation computes both
paths' real time to the first token at that moment (FIFO queue on each worker, then the compute, then
the KV push for the remote path) and checks the decision: a local choice is never slower than the
remote path (pure 1P1D) would have been, the queue rule does fire (the decode GPU takes prompts the
prefill queue would have delayed), and the decode worker's own queue stops it (``decode_busy``) before
local prefill becomes the slower path. Over the run, TTFT p90 is at most pure 1P1D's on the same
arrivals. Ends with the leak checks: no placement open, no token queued.
"""

from __future__ import annotations

import heapq

from fake_clock import Clock

from bench.placement_fakes import request
from router.conditional import ConditionalConfig, PrefillModePolicy
from router.costs import CostConfig
from router.placement import Placer, PlacerConfig, WorkerInfo

RATE = 10_000.0          # tokens/s, both workers (the same GPU)
# every fourth prompt is a short one (a chat's next turn): local by the threshold, unless the decode
# worker's own queue makes that the slower path
SIZES = (2_000, 2_000, 2_000, 200)
ARRIVAL_GAP = 0.05       # 20 prompts/s = ~31k tokens/s against 10k/s: an overload
N = 60
KV_PER_TOKEN = 4096
LINK = 25e9
LATENCY = 0.003
DECODE_S = 1.0           # each request decodes this long after its first token, then ends


def transfer_s(tokens: int) -> float:
    return LATENCY + tokens * KV_PER_TOKEN / LINK


NO_STALL_RULES = dict(max_local_stall_s=float("inf"), stall_weight=0.0)


def make(clock: Clock, stall: dict) -> tuple[Placer, PrefillModePolicy]:
    costs = CostConfig(prefill_tokens_per_s=RATE, default_bandwidth_Bps=LINK, transfer_latency_s=LATENCY,
                       attention_s_per_token_pair=0.0)
    placer = Placer(PlacerConfig(costs=costs), clock=clock, wall=clock)
    placer.update_workers([WorkerInfo("p", "prefill", "a", "i1"),
                           WorkerInfo("d", "decode", "b", "i1", kv_bytes_per_block=16 * KV_PER_TOKEN,
                                      block_size=16, max_num_seqs=256)])
    # the stall rules off: the simulation models TTFT, not what a local prefill costs the running streams
    cfg = ConditionalConfig(min_uncached_tokens=256, max_prefill_wait_s=0.5, local_duty=1.0, **stall)
    return placer, PrefillModePolicy(cfg, placer)


def prompt(i: int) -> list[int]:
    return [(i * 7919 + j * 31) % 32000 for j in range(SIZES[i % len(SIZES)])]


Decisions = list[tuple[str, float, float]]


def simulate(conditional: bool, stall: dict = NO_STALL_RULES) -> tuple[list[float], Decisions, Placer]:
    """TTFT of every prompt, and per decision (reason, chosen path's TTFT, the other path's TTFT)."""
    clock = Clock(0.0)
    placer, policy = make(clock, stall)
    free_at = {"p": 0.0, "d": 0.0}  # when each worker's FIFO prefill queue drains
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, request id)
    seq = 0
    ttfts, decisions = [], []
    sizes: dict[str, int] = {}

    def run_until(t: float) -> None:
        while events and events[0][0] <= t:
            when, _, kind, rid = heapq.heappop(events)
            clock.t = when
            if kind == "answer":  # the prefill worker answered: its compute time teaches the rate
                n = sizes[rid]
                placer.prefill_done(rid, worker_id="p", computed_tokens=n, compute_s=n / RATE)
            elif kind == "local_first":
                placer.prefill_done(rid, answered=True)
            else:
                placer.forget_request(rid)

    for i in range(N):
        now = i * ARRIVAL_GAP
        run_until(now)
        clock.t = now
        rid = f"r{i}"
        tokens = prompt(i)
        n = sizes[rid] = len(tokens)
        pl = placer.place(request(rid, tokens))
        remote_first = max(now, free_at["p"]) + n / RATE
        remote_ttft = remote_first + transfer_s(n) - now
        local_first = max(now, free_at["d"]) + n / RATE
        local_ttft = local_first - now
        if conditional:
            d = policy.decide(rid, n, 0, pl)
            local, reason = d.local, d.reason
        else:
            local, reason = False, "disabled"
        if local:
            free_at["d"] = local_first
            ttfts.append(local_ttft)
            decisions.append((reason, local_ttft, remote_ttft))
            heapq.heappush(events, (local_first, seq, "local_first", rid))
            done = local_first
        else:
            free_at["p"] = remote_first
            ttfts.append(remote_ttft)
            decisions.append((reason, remote_ttft, local_ttft))
            heapq.heappush(events, (remote_first, seq, "answer", rid))
            done = remote_first + transfer_s(n)
        heapq.heappush(events, (done + DECODE_S, seq + 1, "end", rid))
        seq += 2
    run_until(float("inf"))
    return ttfts, decisions, placer


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))]


def test_conditional_never_picks_the_worse_path_under_overload() -> None:
    ttfts, decisions, placer = simulate(conditional=True)
    base, _, base_placer = simulate(conditional=False)
    reasons = [r for r, _, _ in decisions]
    print(f"conditional p90 TTFT {p90(ttfts):.2f} s vs pure 1P1D {p90(base):.2f} s; "
          f"{ {r: reasons.count(r) for r in set(reasons)} }")
    for i, (reason, chosen, other) in enumerate(decisions):
        if reason in ("prefill_busy", "short_suffix", "transfer_slower"):  # went local
            assert chosen <= other + 1e-9, (i, reason, chosen, other)
    assert reasons.count("prefill_busy") > 0  # the decode GPU took prompts the queue would delay
    assert reasons.count("decode_busy") > 0  # and stopped taking them before that became slower
    assert p90(ttfts) <= p90(base)
    assert max(ttfts) <= max(base)
    for pl in (placer, base_placer):  # leak checks
        assert pl.inflight_total == 0
        assert not any(pl.view.outstanding_tokens(w) or pl.view.inflight(w) for w in pl.view.workers)


def test_with_streams_running_the_stall_rules_keep_long_prompts_off_the_decode_worker() -> None:
    # The same overload with the default stall rules: ~20 streams decode on the decode worker at any
    # time, so a 2000-token local prefill (0.2 s) would cost them ~4 s summed, more than the queue it
    # skips, and is over the 50 ms cap; only the short prompts (20 ms, a cheaper path) stay local.
    ttfts, decisions, placer = simulate(conditional=True, stall={})
    reasons = [r for r, _, _ in decisions]
    assert "prefill_busy" not in reasons and reasons.count("decode_stall") > 0
    for (reason, chosen, other), i in zip(decisions, range(N), strict=True):
        if reason == "decode_stall":
            assert len(prompt(i)) == 2_000
        if reason == "short_suffix":
            assert chosen <= other + 1e-9
    assert placer.inflight_total == 0
