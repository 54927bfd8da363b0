"""Simulated "must show" numbers: multi-turn KV reuse with affinity on/off, shared-prompt load bound.

Caches are simulated with the engine's real block hashes and a bounded LRU per worker
(bench/placement_fakes.py); the numbers are printed (pytest -s) and checked against the goals.
"""

from __future__ import annotations

import math

from bench.placement_sim import chat_workload, shared_prompt_workload


def test_five_turn_chat_affinity_on_vs_off():
    on = chat_workload("prefix", sessions=20, turns=5)  # the default: session ids bind
    off = chat_workload("round_robin", sessions=20, turns=5)
    score_only = chat_workload("prefix_only", sessions=20, turns=5)
    for r in (on, score_only, off):
        print(f"{r.policy:<16} hit={r.hit_ratio:.3f} prefill_hit={r.prefill_hit_ratio:.3f} "
              f"bytes={r.bytes_sent} ({r.bytes_sent / r.bytes_no_reuse:.3f} of no-reuse) "
              f"moves={r.session_moves}")
    assert on.hit_ratio >= 0.8  # the goal
    assert on.bytes_sent <= 0.3 * on.bytes_no_reuse
    assert on.hit_ratio > score_only.hit_ratio > off.hit_ratio
    assert on.bytes_sent < off.bytes_sent
    assert on.session_moves == 0


def test_shared_system_prompt_load_stays_within_bound():
    conc, n_decode, eps, N = 32, 8, 0.25, 160
    bounded = shared_prompt_workload("prefix", requests=N, concurrency=conc, n_decode=n_decode,
                                     epsilon=eps)
    unbounded = shared_prompt_workload("prefix", requests=N, concurrency=conc, n_decode=n_decode,
                                       epsilon=1000.0)
    for name, r in (("bounded", bounded), ("unbounded", unbounded)):
        print(f"{name:<10} decode max/mean={r.decode_max}/{r.decode_mean:.1f} "
              f"prefill max/mean={r.prefill_max}/{r.prefill_mean:.1f} "
              f"peak={r.peak_inflight_max_over_mean:.2f}")
    # In flight, no decode worker ever exceeds ceil((1+eps) x average) while others had room.
    assert bounded.peak_inflight_max_over_mean <= math.ceil((1 + eps) * conc / n_decode) / (conc / n_decode)
    # Without the bound, prefix affinity alone piles much of the workload onto one worker.
    assert unbounded.peak_inflight_max_over_mean > 2 * bounded.peak_inflight_max_over_mean
    assert bounded.decode_max <= 0.25 * N  # vs N for the unbounded run
