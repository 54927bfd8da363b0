"""Load generator pieces: length distributions, percentiles, goodput, table."""

from __future__ import annotations

import math
import random

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
                     prefill_compute_ms=80.0, kv_wait_ms=1.5) for i in range(5)]
    local = sample("local", allocate_ms=2.0)  # prefilled by the decode worker: no remote stages
    b = summarize([*remote, local], 1.0)["ttft_breakdown_ms"]
    assert b["requests"] == 5
    assert b["prefill_queue_ms"]["p50"] == pytest.approx(20.0) and b["prefill_queue_ms"]["p90"] == 36.0
    assert b["prefill_compute_ms"]["p90"] == 80.0 and b["kv_wait_ms"]["p50"] == 1.5
    assert summarize([local], 1.0)["ttft_breakdown_ms"] == {}  # colocated / all local: nothing to split
