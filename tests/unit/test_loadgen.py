"""Load generator pieces: length distributions, percentiles, goodput, table."""

from __future__ import annotations

import math
import random
import re

import pytest

from pdserve.app.loadgen.dist import parse_dist
from pdserve.app.loadgen.stats import Sample, format_table, percentile, summarize


def test_parse_dist_kinds_and_bounds() -> None:
    rng = random.Random(0)
    assert parse_dist("512").sample(rng) == 512
    u = parse_dist("uniform:128:512")
    vals = [u.sample(rng) for _ in range(200)]
    assert min(vals) >= 128 and max(vals) <= 512 and len(set(vals)) > 50
    n = parse_dist("normal:100:10")
    vals = [n.sample(rng) for _ in range(500)]
    assert 1 <= min(vals) and max(vals) <= 140 and 90 < sum(vals) / len(vals) < 110
    for bad in ("", "0", "uniform:5:1", "normal:10", "poisson:3", "uniform:a:b", "normal:10:-1"):
        with pytest.raises(ValueError):
            parse_dist(bad)


def test_percentile_interpolates() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 90) == 90
    assert math.isnan(percentile([], 50))


def test_summarize_throughput_and_goodput() -> None:
    fast = Sample(ok=True, ttft_s=0.01, itl_s=[0.001] * 3, tpot_s=0.001, e2e_s=0.013, prompt_tokens=10,
                  output_tokens=4)
    slow = Sample(ok=True, ttft_s=0.5, itl_s=[0.1] * 3, tpot_s=0.1, e2e_s=0.8, prompt_tokens=10,
                  output_tokens=4)
    err = Sample(ok=False, error="UNAVAILABLE")
    s = summarize([fast, slow, err], 2.0, ttft_slo_ms=100, tpot_slo_ms=50)
    assert s["num_ok"] == 2 and s["num_errors"] == 1 and s["errors"] == {"UNAVAILABLE": 1}
    assert s["request_throughput"] == 1.0 and s["output_token_throughput"] == 4.0
    assert s["goodput"] == 0.5 and s["num_good"] == 1  # only `fast` meets both SLOs
    assert s["ttft_ms"]["p50"] == pytest.approx(255.0)
    assert len([v for v in [s["itl_ms"]["p99"]] if v > 0]) == 1
    table = format_table(s, "t")
    assert "ttft_ms" in table and "goodput 0.50" in table
    assert summarize([fast], 1.0)["goodput"] == 1.0  # no SLO: every OK request is good


def test_ttft_breakdown_over_remotely_prefilled_requests_only() -> None:
    def sample(mode: str, **ms) -> Sample:
        return Sample(ok=True, ttft_s=0.1, itl_s=[0.01], tpot_s=0.01, e2e_s=0.2, prompt_tokens=10,
                      output_tokens=2, final={"prefill_mode": mode, **ms})

    remote = [sample("remote", allocate_ms=2.0, prefill_rpc_ms=100.0 + i, prefill_queue_ms=10.0 * i,
                     prefill_compute_ms=80.0, kv_wait_ms=1.5, admission_wait_est_ms=5.0 * i)
              for i in range(5)]
    local = sample("local", allocate_ms=2.0)  # prefilled by the decode worker: no remote stages
    b = summarize([*remote, local], 1.0)["ttft_breakdown_ms"]
    assert b["requests"] == 5
    assert b["prefill_queue_ms"]["p50"] == pytest.approx(20.0) and b["prefill_queue_ms"]["p90"] == 36.0
    assert b["prefill_compute_ms"]["p90"] == 80.0 and b["kv_wait_ms"]["p50"] == 1.5
    assert b["admission_wait_est_ms"]["p50"] == pytest.approx(10.0)  # the router's estimate beside them
    assert summarize([local], 1.0)["ttft_breakdown_ms"] == {}  # colocated / all local: nothing to split


def test_lognormal_median_and_clip() -> None:
    rng = random.Random(1)
    d = parse_dist("lognormal:2000:0.8:256:8192")
    vals = sorted(d.sample(rng) for _ in range(4000))
    assert vals[0] >= 256 and vals[-1] <= 8192 and d.max == 8192
    assert 1800 < vals[len(vals) // 2] < 2200  # the median is the parameter
    assert vals.count(256) > 10 and vals.count(8192) > 10  # both tails clipped, not redrawn
    free = parse_dist("lognormal:100:0.5")
    assert free.max == int(100 * math.exp(2.0)) and min(free.sample(rng) for _ in range(500)) >= 1
    for bad in ("lognormal:0:1", "lognormal:100:-1", "lognormal:100:1:10:5", "lognormal:100:1:0:5",
                "lognormal:100"):
        with pytest.raises(ValueError):
            parse_dist(bad)


def test_trace_replays_pairs_in_order(tmp_path) -> None:
    from pdserve.app.loadgen.dist import load_trace
    from pdserve.app.loadgen.runner import RunConfig, length_source

    path = tmp_path / "t.jsonl"
    path.write_text('{"input": 10, "output": 3}\n\n{"input_len": 20, "output_len": 4}\n'
                    '{"prompt_tokens": 30, "output_tokens": 5}\n')
    trace = load_trace(path)
    assert trace == ((10, 3), (20, 4), (30, 5))
    cfg = RunConfig(router="", rate=1.0, num_requests=4, input_len=parse_dist("1"),
                    output_len=parse_dist("1"), trace=trace)
    draw = length_source(cfg, random.Random(0))
    assert [draw() for _ in range(4)] == [(10, 3), (20, 4), (30, 5), (10, 3)]
    for text, why in (('{"input": 1}\n', ":1:"), ('{"input": 0, "output": 2}\n', ">= 1"), ("x\n", ":1:"),
                      ("\n", "no (input, output)")):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(why)):
            load_trace(path)


def test_parse_rates_and_sweep_config() -> None:
    from pdserve.app.loadgen.sweep import SweepConfig, parse_rates, point_seed

    assert parse_rates("2,4,8") == (2.0, 4.0, 8.0)
    assert parse_rates("geom:1:1.5:4") == (1.0, 1.5, 2.25, 3.375)
    for bad in ("geom:1:1:3", "geom:0:2:3", "a,b", "geom:1:2"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)
    cfg = SweepConfig(rates=(1.0, 4.0), seconds_per_rate=5, min_requests=8)
    assert cfg.requests_at(1.0) == 8 and cfg.requests_at(4.0) == 20
    for kw in ({"rates": (4.0, 2.0)}, {"rates": ()}, {"rates": (1.0,), "target": 0.0},
               {"rates": (float("inf"),)}, {"rates": (1.0,), "overload_factor": -1}):
        with pytest.raises(ValueError):
            SweepConfig(**kw)
    assert point_seed("w", 2.0) == point_seed("w", 2) != point_seed("w", 3.0)


def _point(rate: float, attainment: float, ttft: float = 100.0, itl: float = 10.0) -> dict:
    pct = lambda v: {"p50": v / 2, "p90": v, "p99": v * 2}  # noqa: E731
    n = 20
    good = round(attainment * n)
    return {"rate": rate, "num_requests": n, "num_good": good, "slo_attainment": good / n,
            "ttft_ms": pct(ttft), "itl_ms": pct(itl), "goodput": rate * good / n, "num_shed": n - good,
            "errors_not_shed": 0,
            "errors": {"RESOURCE_EXHAUSTED": n - good} if good < n else {}}


def test_sweep_stops_under_the_target_and_runs_the_overload_point(monkeypatch) -> None:
    from pdserve.app.loadgen import sweep as sweep_mod
    from pdserve.app.loadgen.runner import RunConfig

    curve = {1.0: 1.0, 2.0: 1.0, 4.0: 0.95, 8.0: 0.5, 16.0: 0.1, 6.0: 0.8}
    seen: list[float] = []

    def fake_point(base, cfg, rate, on_done=None):
        seen.append(rate)
        return _point(rate, curve[rate])

    monkeypatch.setattr(sweep_mod, "run_point", fake_point)
    base = RunConfig(router="r", rate=1.0, num_requests=1, input_len=parse_dist("8"),
                     output_len=parse_dist("2"))
    cfg = sweep_mod.SweepConfig(rates=(1.0, 2.0, 4.0, 8.0, 16.0), overload_factor=1.5)
    extra = []
    res = sweep_mod.sweep(base, cfg, desc="m", progress=False, after_point=lambda p: extra.append(p["rate"]))
    assert seen == [1.0, 2.0, 4.0, 8.0, 6.0]  # 16 never run: 8 fell under 95%; then 1.5 x 4
    assert extra == seen
    assert res["slo_goodput_rps"] == 4.0 and res["peak_goodput_rps"] == 4.0  # 8 x 50%
    assert "8 req/s" in res["stopped"] and res["overload"]["rate"] == 6.0
    assert res["overload"]["goodput_over_peak"] == pytest.approx(6 * 0.8 / 4.0)
    assert sweep_mod.frontier([_point(1.0, 0.5), _point(2.0, 0.96)], 0.95) == 2.0  # highest, not first run
    assert sweep_mod.frontier([_point(1.0, 0.5)], 0.95) == 0.0
    text = sweep_mod.table({"m": res, "broken": {"error": "RuntimeError: x"}})
    assert "m: SLO goodput 4 req/s" in text and "6*" in text and "RuntimeError: x" in text


def test_frontier_summary_and_plot(tmp_path) -> None:
    from pdserve.app.loadgen.compare import frontier_summary
    from pdserve.app.loadgen.plot import plot_frontier

    slo = {"ttft_ms": 2000.0, "tpot_ms": 25.0}
    colo = {"points": [_point(2, 1.0), _point(4, 0.96), _point(8, 0.4)], "slo_goodput_rps": 4.0,
            "peak_goodput_rps": 4.0, "slo": slo, "blocks_back": {"all_back": True}}
    pd = {"points": [_point(2, 1.0), _point(4, 0.9), _point(8, 0.97)], "slo_goodput_rps": 8.0,
          "peak_goodput_rps": 3.9, "slo": slo, "blocks_back": {"all_back": False},
          "overload": {**_point(12, 0.7), "goodput_over_peak": 0.9}}
    s = frontier_summary({"colocated": colo, "1p1d-nixl": pd, "bad": {"error": "x"}})
    row = s["modes"]["1p1d-nixl"]
    assert row["slo_goodput_over_baseline"] == 2.0 and row["rates_below_baseline"] == [4]
    assert row["blocks_back"] is False and row["overload"]["shed"] == 6
    assert s["best_other_mode"] == "1p1d-nixl"
    assert "bad" not in s["modes"]
    path = plot_frontier({"colocated": colo, "1p1d-nixl": pd}, tmp_path / "f.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_modes_catalogue_cpu_and_two_gpus() -> None:
    from pdserve.app.loadgen.modes import ModeOptions, cluster_spec, describe

    cpu = ModeOptions(model="M", router_args=("--max-queue-wait-s", "1"), prefill_args=("--x", "1"))
    specs = {m: cluster_spec(m, cpu) for m in ("1p1d", "1p1d-nixl", "1p1d-tcp", "conditional", "colocated")}
    assert [specs[m].transport for m in ("1p1d", "1p1d-nixl", "1p1d-tcp")] == ["tcp", "nixl", "tcp"]
    assert specs["conditional"].router_args == ("--max-queue-wait-s", "1", "--conditional-disagg", "auto")
    assert specs["colocated"].num_decode == 2 and specs["colocated"].colocated
    plan = describe(specs)
    assert plan["1p1d"]["workers"] == [{"role": "prefill", "CUDA_VISIBLE_DEVICES": "", "args": ["--x", "1"]},
                                       {"role": "decode", "CUDA_VISIBLE_DEVICES": "", "args": []}]
    assert plan["colocated"]["router_args"] == ["--max-queue-wait-s", "1", "--mode", "colocated"]
    gpu = ModeOptions(model="M", gpus=2, transport="nixl")
    plan = describe({m: cluster_spec(m, gpu) for m in ("1p1d-oneshot", "colocated-chunk512")})
    assert [w["CUDA_VISIBLE_DEVICES"] for w in plan["1p1d-oneshot"]["workers"]] == ["0,1", "1,0"]
    assert plan["1p1d-oneshot"]["workers"][0]["args"] == ["--kv-stream-layers", "off"]
    assert [w["CUDA_VISIBLE_DEVICES"] for w in plan["colocated-chunk512"]["workers"]] == ["0", "1"]
    with pytest.raises(ValueError, match="unknown modes"):
        cluster_spec("disagg", cpu)
    # MODE@TAG: the same cluster, every process (workers and router) with the variant's flags on top
    both = ModeOptions(model="M", worker_args=("--a",), router_args=("--r",),
                       variants=(("nochain", ("--kv-rx-chain", "off")),))
    base, var = cluster_spec("1p1d-tcp", both), cluster_spec("1p1d-tcp@nochain", both)
    assert var.worker_args == ("--a", "--kv-rx-chain", "off") and base.worker_args == ("--a",)
    assert var.router_args == ("--r", "--kv-rx-chain", "off") and base.router_args == ("--r",)
    assert (var.transport, var.num_prefill, var.num_decode) == (base.transport, 1, 1)
    with pytest.raises(ValueError, match="variant 'other' has no flags; known: nochain"):
        cluster_spec("1p1d-tcp@other", both)
    with pytest.raises(ValueError, match="unknown modes"):
        cluster_spec("disagg@nochain", both)


def test_gpu_frontier_plan_and_report_without_a_gpu(monkeypatch) -> None:
    import argparse
    import sys
    from pathlib import Path

    from pdserve.app.loadgen.compare import frontier_summary

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    monkeypatch.syspath_prepend(bench)
    gf = __import__("gpu_frontier")
    try:
        args = argparse.Namespace(size="small", modes="1p1d-nixl,1p1d-tcp,conditional,colocated",
                                  max_queue_wait_s=1.5, overload_factor=1.5, rates="", stop_below=0.95)
        every = argparse.Namespace(**{**vars(args), "rates": "6,10,14", "stop_below": 0.0})
        assert gf.plan(every, "M", 2, 30.0)[2].rates == (6.0, 10.0, 14.0)
        assert gf.plan(every, "M", 2, 30.0)[2].stop_below == 0.0
        modes, opts, cfg = gf.plan(args, "M", 2, 30.0)
        assert modes == ["1p1d-nixl", "1p1d-tcp", "conditional", "colocated"]
        assert opts.router_args == ("--max-queue-wait-s", "1.5") and opts.prefill_args[-1] == "8192"
        assert cfg.rates == gf.SIZES["small"][0] and cfg.tpot_slo_ms == 25.0 and cfg.overload_factor == 1.5
        slo = {"ttft_ms": 2000.0, "tpot_ms": 25.0}
        results = {"colocated": {"points": [_point(6, 1.0)], "slo_goodput_rps": 6.0, "peak_goodput_rps": 6.0,
                                 "target": 0.95, "stopped": "x", "slo": slo,
                                 "blocks_back": {"all_back": True}},
                   "1p1d-tcp": {"error": "StartFailed: boom"}}
        res = {"device": {"name": "GPU", "count": 2}, "command": "c", "date": "d", "size": "small",
               "results": results, "frontier": frontier_summary(results)}
        text = "\n".join(gf.markdown(res))
        assert "| colocated | 6 | 1.00x |" in text and "1p1d-tcp: StartFailed: boom" in text
    finally:
        sys.modules.pop("gpu_frontier", None)


def test_returning_turns_count_reuse_where_the_prompt_was_computed() -> None:
    from pdserve.app.loadgen.stats import Sample, returning_turns, summarize
    from pdserve.app.loadgen.turns import format_turns

    first = Sample(ok=True, ttft_s=0.5, prompt_tokens=100, turn=0, reusable_tokens=0, final={})
    remote = Sample(ok=True, ttft_s=0.2, tpot_s=0.01, prompt_tokens=200, turn=1, reusable_tokens=160,
                    final={"prefill_mode": "remote", "prefill_cached_tokens": 144, "prefill_tier_tokens": 96,
                           "kv_blocks_reused": 9, "decode_tier_tokens": 32})
    local = Sample(ok=True, ttft_s=0.1, tpot_s=0.02, prompt_tokens=300, turn=2, reusable_tokens=260,
                   final={"prefill_mode": "local", "kv_blocks_reused": 16, "decode_tier_tokens": 256,
                          "prefill_cached_tokens": 0})
    t = returning_turns([first, remote, local], block_size=16)
    assert t["turns"] == 2 and t["reusable_tokens"] == 420
    # remote: 144 not computed on the prefill worker (96 from its tiers); local: 256 on the decode worker
    assert t["reuse_share"] == (144 + 256) / 420
    assert t["reuse_share_from_tiers"] == (96 + 256) / 420
    assert t["reuse_share_device_only"] == (144 - 96) / 420
    assert t["prefill_tokens_per_turn"] == ((200 - 144) + (300 - 256)) / 2
    assert t["ttft_ms"]["p50"] == 150.0 and t["decode_tier_tokens"] == 288 and t["prefill_tier_tokens"] == 96
    summary = summarize([first, remote, local], 1.0)
    assert summary["returning_turns"] == t
    assert "returning_turns" not in summarize([first], 1.0)  # single turns have none
    table = format_turns({"off": {**summary, "blocks_back": {"all_back": True}}, "broken": {"error": "boom"}})
    assert "95.2%" in table and "83.8%" in table and "boom" in table
