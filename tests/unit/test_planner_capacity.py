"""The planner's capacity model: seeded from a ``pdserve bench --sweep`` profile (its shape as
pdserve/app/loadgen/sweep.py writes it) and learned online from busy windows that met the SLO."""

from __future__ import annotations

import json

import pytest

from pdserve.app.planner.capacity import CapacityModel, Estimate, Seed, load_sweep, seed_from_sweep
from pdserve.app.planner.signals import Signals


def point(rate: float, attainment: float, *, duration: float = 20.0, prompt_tokens: int, out_tok_s: float,
          req_s: float, e2e_mean_ms: float, ttft_mean_ms: float, hit: float = 0.0, cpu_roles=()) -> dict:
    p = {"rate": rate, "slo_attainment": attainment, "duration_s": duration, "num_ok": int(req_s * duration),
         "output_token_throughput": out_tok_s, "request_throughput": req_s,
         "e2e_ms": {"mean": e2e_mean_ms}, "ttft_ms": {"mean": ttft_mean_ms},
         "kv": {"prompt_tokens": prompt_tokens, "prefill_hit_ratio": hit}, "goodput": req_s * attainment}
    if cpu_roles:
        p["cpu"] = {"processes": {f"{r}-{i}": {"role": r} for i, r in enumerate(cpu_roles)}}
    return p


def sweep_file(**modes: list[dict]) -> dict:
    return {"results": {name: {"points": pts, "target": 0.95, "slo": {"ttft_ms": 1500.0, "tpot_ms": 30.0},
                               "stopped": "x", "slo_goodput_rps": 0.0, "peak_goodput_rps": 0.0}
                        for name, pts in modes.items()},
            "config": {}, "frontier": {}}


def test_seeds_come_from_the_highest_rate_that_met_the_slo():
    pts = [point(2, 1.0, prompt_tokens=40 * 1000, out_tok_s=400, req_s=2, e2e_mean_ms=5300, ttft_mean_ms=300),
           point(4, 0.97, prompt_tokens=80 * 1000, out_tok_s=800, req_s=4, e2e_mean_ms=5500, ttft_mean_ms=500,
                 hit=0.25),
           point(8, 0.60, prompt_tokens=160 * 1000, out_tok_s=1200, req_s=6, e2e_mean_ms=9000,
                 ttft_mean_ms=3000)]
    data = sweep_file(**{"1p1d-tcp": pts, "colocated": pts})
    seed = seed_from_sweep(data, mode="1p1d-tcp")
    assert seed.prefill_tokens_per_s == pytest.approx(80_000 * 0.75 / 20)  # prefix hits are not computed
    assert seed.decode_tokens_per_s == 800
    assert seed.decode_sequences == pytest.approx(4 * 5.0)  # Little: 4 req/s x 5 s from first to last token
    assert "1p1d-tcp @ 4 req/s" in seed.source and "TTFT 1500.0 ms" in seed.source
    # a --router sweep of a 2P3D cluster: the pools from the point's CPU report, per worker
    big = sweep_file(mine=[point(4, 1.0, prompt_tokens=90_000, out_tok_s=900, req_s=4, e2e_mean_ms=2000,
                                 ttft_mean_ms=500, cpu_roles=("router", "prefill", "prefill", "decode",
                                                              "decode", "decode"))])
    seed = seed_from_sweep(big)
    assert (seed.prefill_tokens_per_s, seed.decode_tokens_per_s) == (90_000 / 20 / 2, 300)
    assert seed_from_sweep(big, prefill_workers=3).prefill_tokens_per_s == 90_000 / 20 / 3


def test_profiles_that_cannot_seed_say_why(tmp_path):
    good = [point(1, 1.0, prompt_tokens=1000, out_tok_s=10, req_s=1, e2e_mean_ms=1000, ttft_mean_ms=100)]
    with pytest.raises(ValueError, match="choose one with --profile-mode"):
        seed_from_sweep(sweep_file(a=good, b=good))
    with pytest.raises(ValueError, match="no mode 'c'"):
        seed_from_sweep(sweep_file(a=good, b=good), mode="c")
    with pytest.raises(ValueError, match="colocated mode has no prefill pool"):
        seed_from_sweep(sweep_file(colocated=good))
    bad = [point(1, 0.5, prompt_tokens=1000, out_tok_s=10, req_s=1, e2e_mean_ms=1000, ttft_mean_ms=100)]
    with pytest.raises(ValueError, match="no swept rate met the SLOs"):
        seed_from_sweep(sweep_file(conditional=bad))
    with pytest.raises(ValueError, match="no \"results\""):
        seed_from_sweep({"points": []})
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep_file(conditional=good)))
    assert load_sweep(path).source.startswith("sweep.json: conditional @ 1 req/s")


def test_an_estimate_moves_only_on_windows_that_say_something():
    e = Estimate("tokens/s", 1000.0, 1000.0, "seed")

    def learn(observed: float, *, met: bool, saturated: bool = False, loaded: bool = False) -> bool:
        return e.learn(observed, met=met, saturated=saturated, loaded=loaded, alpha=0.5)

    assert not learn(500.0, met=True)  # light load within the SLO: says nothing of capacity
    assert not learn(500.0, met=True, loaded=True)  # nor near the estimate without a queue
    assert not learn(500.0, met=False)  # a miss at light load: not capacity
    assert not learn(1500.0, met=False, saturated=True)  # a miss doing more than the estimate
    assert e.value == 1000.0 and e.samples == 0
    assert learn(1400.0, met=True) and e.value == 1200.0  # did more within the SLO
    assert learn(1000.0, met=True, saturated=True) and e.value == 1100.0  # flat out within the SLO
    assert learn(300.0, met=False, loaded=True) and e.value == 700.0  # loaded and missing
    for _ in range(20):
        learn(0.0, met=False, saturated=True)  # a stalled pool
    assert e.value == pytest.approx(100.0)  # a tenth of the seed, no lower


def test_the_model_learns_from_busy_windows_that_met_the_slo():
    m = CapacityModel(seed=Seed(prefill_tokens_per_s=1000.0, decode_tokens_per_s=500.0,
                                decode_sequences=10.0), alpha=0.5)

    def window(**kw) -> Signals:
        base = dict(at=0.0, window_s=10.0, prefill_replicas=2, decode_replicas=2, ttft_p90_s=1.0,
                    tpot_p90_s=0.02)
        return Signals(**{**base, **kw})

    # 2 prefill workers computing 12,000 tokens in 10 s within TTFT, queue at both ends: 600/s each
    assert m.learn(window(prefill_computed_tokens=12_000, prefill_waiting=3), ttft_s=2.0, tpot_s=0.025) == []
    moved = m.learn(window(prefill_computed_tokens=12_000, prefill_waiting=3), ttft_s=2.0, tpot_s=0.025)
    assert m.prefill.value == 800.0 and m.prefill.source == "learned" and "1,000.0 -> 800.0" in moved[0]
    # decode: 2 workers at 12 sequences each and 700 tokens/s each within TPOT: above both estimates
    m.learn(window(output_tokens=14_000, decode_running=24, kv_blocks_used=50, kv_blocks_total=400),
            ttft_s=2.0, tpot_s=0.025)
    assert (m.decode_tokens.value, m.decode_sequences.value) == (600.0, 11.0)
    assert m.kv_blocks_per_worker == 200.0
    # TPOT missed while 9 sequences per worker ran: fewer fit, and they made fewer tokens
    m.learn(window(output_tokens=6_000, decode_running=18, tpot_p90_s=0.05), ttft_s=2.0, tpot_s=0.025)
    assert m.decode_sequences.value == 10.0 and m.decode_tokens.value == 450.0
    # within TPOT at 4 sequences and 100 tokens/s per worker, no queue: nothing to learn
    assert m.learn(window(output_tokens=2_000, decode_running=8), ttft_s=2.0, tpot_s=0.025) == []
    # no percentile in the window: nothing learned
    quiet = window(output_tokens=1e6, ttft_p90_s=None, tpot_p90_s=None)
    assert m.learn(quiet, ttft_s=2.0, tpot_s=0.025) == []
    with pytest.raises(ValueError, match="alpha"):
        CapacityModel(alpha=0.0)
    with pytest.raises(ValueError, match="decode_sequences"):
        Seed(decode_sequences=0.0)
