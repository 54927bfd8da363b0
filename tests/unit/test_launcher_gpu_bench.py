"""bench/gpu.py's disaggregated-vs-colocated item, CPU side: the clusters it would launch (roles,
devices, router flags) and its tables, without a GPU. The GPU run itself is bench/device_run.sh."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def gd():
    sys.path.insert(0, str(BENCH))
    try:
        importlib.import_module("gpu")  # the driver script imports on a machine without CUDA
        yield importlib.import_module("gpu_disagg")
    finally:
        sys.path.remove(str(BENCH))


def test_two_gpus_each_worker_on_its_own(gd) -> None:
    plan = gd.describe(gd.cluster_specs("M", n_gpus=2, kv_gb=30.0))
    assert plan["disaggregated"]["workers"] == [
        {"role": "prefill", "CUDA_VISIBLE_DEVICES": "0,1", "args": ["--max-num-batched-tokens", "8192"]},
        {"role": "decode", "CUDA_VISIBLE_DEVICES": "1,0", "args": []}]
    assert plan["disaggregated"]["transport"] == "nixl" and plan["disaggregated"]["router_args"] == []
    assert plan["conditional"]["router_args"] == ["--conditional-disagg", "auto"]
    assert plan["colocated"]["workers"] == [{"role": "colocated", "CUDA_VISIBLE_DEVICES": "0", "args": []},
                                            {"role": "colocated", "CUDA_VISIBLE_DEVICES": "1", "args": []}]
    assert plan["colocated"]["router_args"] == ["--mode", "colocated"]
    assert [w["args"] for w in plan["colocated-chunk512"]["workers"]] == [
        ["--max-num-batched-tokens", "512"]] * 2
    assert plan["conditional"]["workloads"] == ["long_prompt", "short_prompt"]
    assert plan["disaggregated"]["workloads"] == ["long_prompt", "short_prompt"]


def test_every_rate_point_draws_its_own_prompts_the_same_in_every_mode(gd) -> None:
    seeds = {gd.point_seed(w, r) for w, (_, _, rates, _) in gd.WORKLOADS.items() for r in rates}
    assert len(seeds) == sum(len(v[2]) for v in gd.WORKLOADS.values())
    assert gd.point_seed("long_prompt", 2.0) == gd.point_seed("long_prompt", 2)
    # requests per point = rate x seconds of arrivals (at least 8); quick keeps each workload's first rate
    pts = gd.rate_points({"w": ("1", "1", (2.0, 10.0), 25.0)})
    assert pts == [("w", 2.0, 50), ("w", 10.0, 250)]
    assert gd.rate_points({"w": ("1", "1", (0.1, 9.0), 25.0)}, quick=True) == [("w", 0.1, 8)]


def test_one_gpu_shares_it_and_modes_filter(gd) -> None:
    plan = gd.describe(gd.cluster_specs("M", n_gpus=1, kv_gb=4.0, modes=("disaggregated", "colocated")))
    assert list(plan) == ["disaggregated", "colocated"]
    assert [w["CUDA_VISIBLE_DEVICES"] for w in plan["disaggregated"]["workers"]] == ["0", "0"]
    assert plan["colocated"]["workers"] == [{"role": "colocated", "CUDA_VISIBLE_DEVICES": "0", "args": []}]


def _summary(ttft: float, itl: float, goodput: float) -> dict:
    pct = lambda v: {"p50": v, "p90": v * 1.5, "p99": v * 2}  # noqa: E731
    return {"ttft_ms": pct(ttft), "itl_ms": pct(itl), "tpot_ms": pct(itl), "e2e_ms": pct(1000.0),
            "output_token_throughput": 200.0, "goodput": goodput}


def test_compare_and_markdown_cover_all_three_modes(gd) -> None:
    res = {"disaggregated": {"long_prompt@2": _summary(300, 10, 1.8)},
           "conditional": {"long_prompt@2": _summary(280, 12, 1.9)},
           "colocated": {"long_prompt@2": _summary(250, 40, 1.5), "short_prompt@8": {"status": "skipped"}},
           "colocated-chunk512": {"long_prompt@2": _summary(250, 30, 1.5)},
           "conditional_error": "RuntimeError: x"}
    cmp = gd.compare(res)
    assert cmp["long_prompt@2"]["p90_itl_colocated_over_disagg"] == pytest.approx(4.0)
    assert cmp["conditional:long_prompt@2"]["p90_itl_colocated_over_disagg"] == pytest.approx(40 / 12)
    assert cmp["long_prompt@2 vs colocated-chunk512"]["p90_itl_colocated_over_disagg"] == pytest.approx(3.0)
    assert cmp["long_prompt@2 vs colocated-chunk512"]["baseline"] == "colocated-chunk512"
    res["comparison"] = cmp
    text = "\n".join(gd.markdown(res))
    assert "| long_prompt@2 | conditional |" in text and "skipped" in text and "conditional_error" in text


def test_dry_run_prints_the_plan() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "gpu_disagg.py"), "--dry-run"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert '"--mode"' in out and '"long_prompt"' in out
