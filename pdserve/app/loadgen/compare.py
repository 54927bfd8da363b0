"""Serving modes side by side in one run: start each (``modes.py``), sweep its goodput frontier
(``sweep.py``), check its blocks came back, bring it down, next.

Used by ``pdserve bench --sweep --model DIR --modes 1p1d-tcp,conditional,colocated`` (CPU or GPU) and by
bench/gpu_frontier.py. Every mode gets the same workload, the same rate points and the same prompts
per point; its router serves Prometheus metrics on a free port, scraped after every point (the
``pdserve_router_*`` admission and prefill-decision counters, cumulative). Timings are only meaningful
as ratios taken in one run on one machine; nothing here asserts them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

from pdserve import event_loop
from pdserve.app.loadgen.dist import parse_dist
from pdserve.app.loadgen.modes import ModeOptions, cluster_spec, describe, started
from pdserve.app.loadgen.runner import RunConfig, run
from pdserve.app.loadgen.sweep import SweepConfig, sweep
from pdserve.probe import free_port, scrape_metrics

ROUTER_METRICS = re.compile(r"^pdserve_router_(prefill_decisions|admission_|allocate_queue_)(?!.*_created\b)")


def warm(router: str, vocab_size: int, input_lens: tuple[int, ...] = (8,)) -> None:
    """Two requests per prompt length (cold kernels and allocator growth stay out of the first point)."""
    for i, n in enumerate(input_lens):
        event_loop.run(run(RunConfig(router=router, rate=float("inf"), num_requests=2,
                                  input_len=parse_dist(str(n)), output_len=parse_dist("4"),
                                  vocab_size=vocab_size, seed=(1 << 25) + i)))


def router_metrics(port: int) -> dict[str, float]:
    """The router's admission and prefill-decision samples, by full sample name."""
    try:
        return {k: v for k, v in scrape_metrics(port).items() if ROUTER_METRICS.match(k)}
    except OSError as exc:
        return {"scrape_error": repr(exc)}  # type: ignore[dict-item]


def run_modes(modes: list[str], opts: ModeOptions, base: RunConfig, cfg: SweepConfig, *, run_dir: str | Path,
              env: dict[str, str] | None = None, progress: bool | None = None,
              warm_input_lens: tuple[int, ...] = (8,), budget_s: float = math.inf,
              on_mode: Callable[[str, dict], None] | None = None) -> dict[str, dict]:
    """mode -> its sweep result (``sweep.sweep``'s dict plus ``cluster``, ``startup_s``,
    ``blocks_back``), or ``{"error": ...}`` when the mode could not be started or swept. ``budget_s``
    is split evenly between the modes: a mode past its share sweeps no further point."""
    import time

    results: dict[str, dict] = {}
    start = time.monotonic()
    for i, mode in enumerate(modes):
        deadline = start + budget_s * (i + 1) / len(modes)
        port = free_port()
        spec = cluster_spec(mode, dataclasses.replace(
            opts, router_args=(*opts.router_args, "--metrics-port", str(port))))
        res: dict = {"cluster": describe({mode: spec})[mode]}
        t0 = time.monotonic()
        try:
            with started(spec, Path(run_dir) / mode, env) as c:
                res["startup_s"] = time.monotonic() - t0
                print(f"{mode}: up in {res['startup_s']:.0f} s, router {c.router}", file=sys.stderr,
                      flush=True)
                warm(c.router, base.vocab_size, warm_input_lens)
                free0 = c.blocks_back({}, timeout=0)["workers"]

                def scrape(point: dict, port: int = port) -> None:
                    point["router_metrics"] = router_metrics(port)

                res.update(sweep(dataclasses.replace(base, router=c.router), cfg, desc=mode,
                                 progress=progress, after_point=scrape, deadline=deadline))
                res["blocks_back"] = c.blocks_back({w: r["free"] for w, r in free0.items()})
        except Exception as exc:  # one mode failing must not cost the others' numbers
            res["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{mode} failed: {res['error']}", file=sys.stderr, flush=True)
        results[mode] = res
        if on_mode is not None:
            on_mode(mode, res)
    return results


def frontier_summary(results: dict[str, dict], baseline: str = "colocated") -> dict:
    """Per mode: SLO goodput, peak goodput, and both over the baseline's; the best mode; whether a
    disaggregated mode is never below the baseline's attainment at a rate both swept."""
    base = results.get(baseline) or {}
    out: dict = {"baseline": baseline, "modes": {}}
    for mode, res in results.items():
        if "points" not in res:
            continue
        row = {"slo_goodput_rps": res["slo_goodput_rps"], "peak_goodput_rps": res["peak_goodput_rps"]}
        if base.get("slo_goodput_rps"):
            row["slo_goodput_over_baseline"] = res["slo_goodput_rps"] / base["slo_goodput_rps"]
        if "points" in base and mode != baseline:
            theirs = {p["rate"]: p["slo_attainment"] for p in base["points"]}
            below = [p["rate"] for p in res["points"]
                     if p["rate"] in theirs and p["slo_attainment"] < theirs[p["rate"]]]
            row["rates_below_baseline"] = below
        if "overload" in res:
            o = res["overload"]
            row["overload"] = {"rate": o["rate"], "errors_not_shed": o["errors_not_shed"],
                               "shed": o["num_shed"],
                               "ttft_p90_admitted_ms": o["ttft_ms"]["p90"],
                               "goodput_over_peak": o["goodput_over_peak"]}
        row["blocks_back"] = (res.get("blocks_back") or {}).get("all_back")
        out["modes"][mode] = row
    others = {m: r for m, r in out["modes"].items() if m != baseline}
    if others:
        best = max(others, key=lambda m: others[m]["slo_goodput_rps"])
        out["best_other_mode"] = best
    return out
