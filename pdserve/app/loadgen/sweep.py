"""The goodput frontier of one router: a rate sweep until SLO attainment falls under a target.

Each rate point is an open-loop Poisson run (``runner.run``) of ``rate x seconds_per_rate`` requests
(at least ``min_requests``) with its own prompts (``point_seed``: never the same prompts at two rates,
so the prefix cache cannot answer a later point for free; the same prompts in every mode). Rates go
up in order; the sweep stops after the first point whose SLO attainment (requests within both the
TTFT and TPOT targets, of all sent: refused and failed ones are misses) is under ``stop_below``.

**SLO goodput** is the highest rate whose attainment is at least ``target`` (0.95): the load a
deployment can be sold at. ``peak_goodput_rps`` is the most requests per second served within the
SLOs at any point. ``overload_factor`` (e.g. 1.5) adds one more point at that multiple of the SLO
goodput rate: what admission control is for (sheds, the admitted requests' TTFT, goodput kept).
Each point also carries what it cost in CPU (``cpu``: per process, per request and output token, and
the cluster's CPU cores per 1k output tokens/s; ``loadgen/cpu.py``), where the cluster serves it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from pdserve import event_loop
from pdserve.app.loadgen import cpu
from pdserve.app.loadgen.runner import RunConfig, run
from pdserve.app.loadgen.stats import Sample, summarize


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    rates: tuple[float, ...]
    seconds_per_rate: float = 20.0
    min_requests: int = 8
    target: float = 0.95
    stop_below: float = 0.95
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 25.0
    overload_factor: float = 0.0  # 0: no overload point
    label: str = "sweep"          # seeds the prompts (with the rate)

    def __post_init__(self) -> None:
        if not self.rates or any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ValueError(f"rates must be finite and > 0, got {self.rates}")
        if list(self.rates) != sorted(set(self.rates)):
            raise ValueError(f"rates must be strictly increasing, got {self.rates}")
        if not self.seconds_per_rate > 0 or self.min_requests < 1:
            raise ValueError("seconds_per_rate must be > 0 and min_requests >= 1")
        if not (0 < self.target <= 1 and 0 <= self.stop_below <= 1):
            raise ValueError(f"target must be in (0, 1] and stop_below in [0, 1], got {self.target}, "
                             f"{self.stop_below}")
        if self.overload_factor < 0 or not (self.ttft_slo_ms > 0 and self.tpot_slo_ms > 0):
            raise ValueError("overload_factor must be >= 0 and the SLO targets > 0")

    def requests_at(self, rate: float) -> int:
        return max(self.min_requests, round(rate * self.seconds_per_rate))


def parse_rates(spec: str) -> tuple[float, ...]:
    """``2,4,8`` or ``geom:START:FACTOR:COUNT`` (``geom:1:1.5:6`` = 1, 1.5, 2.25, ...)."""
    try:
        if spec.startswith("geom:"):
            start, factor, count = spec[5:].split(":")
            a, f, n = float(start), float(factor), int(count)
            if not (a > 0 and f > 1 and n >= 1):
                raise ValueError("need START > 0, FACTOR > 1, COUNT >= 1")
            return tuple(round(a * f ** i, 3) for i in range(n))
        return tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"bad --rates {spec!r} (use 2,4,8 or geom:START:FACTOR:COUNT): {exc}") from None


def point_seed(label: str, rate: float) -> int:
    """The prompts' seed of one rate point: its own per point, the same in every mode."""
    return zlib.crc32(f"{label}@{rate:g}".encode()) & 0xFFFFFF


def run_point(base: RunConfig, cfg: SweepConfig, rate: float,
              on_done: Callable[[Sample], None] | None = None) -> dict:
    """One open-loop run at ``rate``; the summary plus the rate and its attainment."""
    n = cfg.requests_at(rate)
    run_cfg = dataclasses.replace(base, rate=rate, num_requests=n, seed=point_seed(cfg.label, rate))
    before = cpu.try_read(base.router, backend=base.backend, api_key=base.api_key)
    samples, duration = event_loop.run(run(run_cfg, on_done))
    after = cpu.try_read(base.router, backend=base.backend, api_key=base.api_key)
    summary = summarize(samples, duration, ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms)
    if before and after:  # what the point cost each process of the cluster (loadgen/cpu.py)
        summary["cpu"] = cpu.report(before, after, summary)
    summary["rate"] = rate
    summary["errors_not_shed"] = sum(v for k, v in summary["errors"].items() if k != "RESOURCE_EXHAUSTED")
    summary["num_shed"] = summary["errors"].get("RESOURCE_EXHAUSTED", 0)
    return summary


def frontier(points: list[dict], target: float) -> float:
    """The highest swept rate with SLO attainment >= ``target`` (0.0: none)."""
    ok = [p["rate"] for p in points if p.get("slo_attainment", 0.0) >= target]
    return max(ok, default=0.0)


def sweep(base: RunConfig, cfg: SweepConfig, *, desc: str = "", progress: bool | None = None,
          after_point: Callable[[dict], None] | None = None, deadline: float = math.inf) -> dict:
    """Sweep ``cfg.rates`` against ``base.router``; see the module doc. ``after_point(summary)`` may add
    to each point's summary (router metrics); ``progress`` None shows the bar on a terminal only; past
    ``deadline`` (``time.monotonic``) no further point starts."""
    from tqdm import tqdm

    planned = sum(cfg.requests_at(r) for r in cfg.rates)
    points: list[dict] = []
    stopped = "every rate swept"
    with tqdm(total=planned, desc=desc or base.router, unit="req", file=sys.stderr, leave=False,
              disable=None if progress is None else not progress, dynamic_ncols=True) as bar:
        for rate in cfg.rates:
            if time.monotonic() > deadline:
                stopped = f"time budget spent before {rate:g} req/s"
                break
            bar.set_postfix_str(f"{rate:g} req/s")
            point = run_point(base, cfg, rate, lambda _s: bar.update(1))
            if after_point is not None:
                after_point(point)
            points.append(point)
            print(f"  {desc} @ {rate:g} req/s: {point_line(point)}", file=sys.stderr, flush=True)
            if point["slo_attainment"] < cfg.stop_below:
                stopped = f"attainment {point['slo_attainment']:.0%} < {cfg.stop_below:.0%} at {rate:g} req/s"
                break
    out = {"points": points, "stopped": stopped, "target": cfg.target,
           "slo": {"ttft_ms": cfg.ttft_slo_ms, "tpot_ms": cfg.tpot_slo_ms},
           "slo_goodput_rps": frontier(points, cfg.target),
           "peak_goodput_rps": max((p["goodput"] for p in points), default=0.0)}
    rate = out["slo_goodput_rps"]
    if cfg.overload_factor and rate and time.monotonic() <= deadline:
        over = run_point(base, cfg, round(rate * cfg.overload_factor, 3))
        if after_point is not None:
            after_point(over)
        over["factor"] = cfg.overload_factor
        peak = out["peak_goodput_rps"]
        over["goodput_over_peak"] = over["goodput"] / peak if peak else 0.0
        print(f"  {desc} overload @ {over['rate']:g} req/s: {point_line(over)}", file=sys.stderr, flush=True)
        out["overload"] = over
    return out


def point_line(p: dict) -> str:
    return (f"within SLO {p['num_good']}/{p['num_requests']} ({p['slo_attainment']:.0%}), TTFT p90 "
            f"{p['ttft_ms']['p90']:.0f} ms, ITL p90 {p['itl_ms']['p90']:.1f} ms, "
            f"goodput {p['goodput']:.2f}/s, "
            f"shed {p['num_shed']}, other errors {p['errors_not_shed']}")


def table(results: dict[str, dict]) -> str:
    """One row per (mode, rate): attainment, TTFT and ITL p50/p90/p99, goodput; then the frontier."""
    head = (f"{'mode':<20}{'rate':>7}{'in SLO':>8}{'TTFT p50/p90/p99 ms':>24}{'ITL p50/p90/p99 ms':>22}"
            f"{'goodput':>9}{'shed':>6}{'err':>5}{'cores/1k tok/s':>16}")
    lines = [head, "-" * len(head)]
    for mode, res in results.items():
        if "points" not in res:
            lines.append(f"{mode:<20} {res.get('error', 'not run')}")
            continue
        rows = [*res["points"], *([res["overload"]] if "overload" in res else [])]
        for p in rows:
            t, i = p["ttft_ms"], p["itl_ms"]
            tag = f"{p['rate']:g}" + ("*" if p is res.get("overload") else "")
            ttft = f"{t['p50']:.0f}/{t['p90']:.0f}/{t['p99']:.0f}"
            itl = f"{i['p50']:.1f}/{i['p90']:.1f}/{i['p99']:.1f}"
            per_1k = p["cpu"]["cluster"]["cores_per_1k_output_tok_s"] if "cpu" in p else float("nan")
            lines.append(f"{mode:<20}{tag:>7}{p['slo_attainment']:>8.0%}{ttft:>24}{itl:>22}"
                         f"{p['goodput']:>9.2f}{p['num_shed']:>6}{p['errors_not_shed']:>5}{per_1k:>16.2f}")
    lines.append("")
    for mode, res in results.items():
        if "points" in res:
            lines.append(f"{mode}: SLO goodput {res['slo_goodput_rps']:g} req/s (attainment >= "
                         f"{res['target']:.0%}), peak {res['peak_goodput_rps']:.2f} req/s within the SLOs; "
                         f"stopped: {res['stopped']}")
    if any("overload" in r for r in results.values()):
        lines.append("* = overload point (a multiple of the mode's SLO goodput rate)")
    return "\n".join(lines)
