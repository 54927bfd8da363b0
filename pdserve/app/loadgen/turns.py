"""Multi-turn sessions on several configurations side by side: start each (``modes.py``, a ``MODE@TAG``
variant adding flags), send every one the same seeded sessions (``runner.run`` with ``sessions``,
``turns`` and ``think_time_s``), check its blocks came back, bring it down, next.

Used by ``pdserve bench --model DIR --modes M1,M2 --sessions K --turns T`` (no ``--sweep``): for
instance KV tiers off against on, ``--modes 1p1d-tcp,1p1d-tcp@tiers --variant "tiers=--kv-host-gb 1
--kv-disk-dir DIR --kv-disk-gb 8"``. The table and JSON put each configuration's returning-turn reuse
(stats.returning_turns), TTFT and TPOT beside the others'. Timings are ratios of one run on one
machine; nothing here asserts them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from pdserve import event_loop
from pdserve.app.loadgen.compare import warm
from pdserve.app.loadgen.modes import ModeOptions, cluster_spec, describe, started
from pdserve.app.loadgen.runner import RunConfig, run
from pdserve.app.loadgen.stats import summarize


def run_turns(modes: list[str], opts: ModeOptions, base: RunConfig, *, run_dir: str | Path,
              block_size: int = 16, env: dict[str, str] | None = None) -> dict[str, dict]:
    """mode -> ``stats.summarize`` of its run (with ``returning_turns``), plus ``cluster``,
    ``blocks_back``; or ``{"error": ...}`` when it could not be started or run."""
    results: dict[str, dict] = {}
    for mode in modes:
        spec = cluster_spec(mode, opts)
        res: dict = {"cluster": describe({mode: spec})[mode]}
        try:
            with started(spec, Path(run_dir) / mode.replace("@", "-"), env) as c:
                print(f"{mode}: up, router {c.router}", file=sys.stderr, flush=True)
                warm(c.router, base.vocab_size)
                free0 = c.blocks_back({}, timeout=0)["workers"]
                samples, duration = event_loop.run(run(dataclasses.replace(base, router=c.router)))
                res.update(summarize(samples, duration, block_size=block_size))
                res["blocks_back"] = c.blocks_back({w: r["free"] for w, r in free0.items()})
        except Exception as exc:  # one configuration failing must not cost the others' numbers
            res["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{mode} failed: {res['error']}", file=sys.stderr, flush=True)
        results[mode] = res
    return results


def _f(value: float, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_turns(results: dict[str, dict]) -> str:
    head = (f"{'configuration':<24}{'ok':>8}{'reuse':>8}{'device':>8}{'tiers':>8}{'prefill':>9}"
            f"{'TTFT p50':>10}{'p90':>8}{'TPOT p50':>10}{'p90':>8}{'blocks':>8}")
    sub = (f"{'':<24}{'':>8}{'(any)':>8}{'only':>8}{'':>8}{'tok/turn':>9}{'ms':>10}{'ms':>8}{'ms':>10}"
           f"{'ms':>8}{'back':>8}")
    lines = ["returning turns (every turn of a session after its first)", head, sub]
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"{mode:<24}  {r['error']}")
            continue
        t = r.get("returning_turns") or {}
        ttft, tpot = t.get("ttft_ms", {}), t.get("tpot_ms", {})
        shares = "".join(f"{_f(t.get(k), '.1%'):>8}" for k in
                         ("reuse_share", "reuse_share_device_only", "reuse_share_from_tiers"))
        lines.append(f"{mode:<24}{r['num_ok']:>4}/{r['num_requests']:<3}{shares}"
                     f"{_f(t.get('prefill_tokens_per_turn'), '.0f'):>9}"
                     f"{_f(ttft.get('p50'), '.1f'):>10}{_f(ttft.get('p90'), '.1f'):>8}"
                     f"{_f(tpot.get('p50'), '.2f'):>10}{_f(tpot.get('p90'), '.2f'):>8}"
                     f"{str((r.get('blocks_back') or {}).get('all_back', '-')):>8}")
    return "\n".join(lines)
