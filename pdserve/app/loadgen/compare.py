"""Disaggregated vs colocated, side by side on this host: ``python -m pdserve.app.loadgen.compare``.

Modes (``--modes``, each started with the `pdserve up --launcher process` code path, one at a time):

    disaggregated_1p1d   1 prefill + 1 decode + router
    conditional_1p1d     the same with --conditional-disagg auto (short prompts prefill on decode)
    colocated_2_router   2 colocated workers behind one router (--mode colocated)
    colocated            one colocated server, no router (the original baseline)

The same `pdserve bench` workload runs against each (same seed, so the same prompts and arrival
times); it prints every table plus ratios against ``--baseline`` and writes one JSON. Timings are
only meaningful as ratios taken in one run on one machine; nothing here asserts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from pdserve.app.launcher.local import LocalCluster, colocated
from pdserve.app.loadgen.dist import parse_dist
from pdserve.app.loadgen.runner import RunConfig, run
from pdserve.app.loadgen.stats import format_table, summarize
from pdserve.probe import free_port, scrape_metrics


def bench(router: str, args: argparse.Namespace) -> dict:
    cfg = RunConfig(router=router, rate=args.rate, num_requests=args.num_requests,
                    input_len=parse_dist(args.input_len), output_len=parse_dist(args.output_len),
                    sessions=args.sessions, turns=args.turns, vocab_size=args.vocab_size, seed=args.seed)
    asyncio.run(run(RunConfig(router=router, rate=float("inf"), num_requests=2, input_len=parse_dist("8"),
                              output_len=parse_dist("2"), vocab_size=args.vocab_size)))  # warm-up
    samples, duration = asyncio.run(run(cfg))
    return summarize(samples, duration, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms)


MODES = ("disaggregated_1p1d", "conditional_1p1d", "colocated_2_router", "colocated")


def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict:
    worker_args = ("--num-blocks", str(args.num_blocks))
    if mode == "colocated":
        proc = colocated(args.model, log_path=tmp / "colocated.log", args=worker_args)
        try:
            return bench(proc.address, args)
        finally:
            proc.stop(30)
    router_args: tuple[str, ...] = ()
    if mode == "conditional_1p1d":
        router_args = ("--conditional-disagg", "auto", "--min-uncached-tokens", str(args.min_uncached_tokens))
    two = mode == "colocated_2_router"
    port = free_port()
    with LocalCluster(args.model, prefill=0 if two else 1, decode=2 if two else 1, colocated=two,
                      transport=args.transport, run_dir=tmp / mode, worker_args=worker_args, policy="prefix",
                      router_args=(*router_args, "--metrics-port", str(port))) as c:
        summary = bench(c.router, args)
        summary["prefill_decisions"] = _decisions(port)  # warm-up requests included
        return summary


def _decisions(port: int) -> dict[str, float]:
    """The router's pdserve_router_prefill_decisions_total, as {"mode/reason": count}."""
    import re

    pat = re.compile(r'^pdserve_router_prefill_decisions_total\{mode="(\w+)",reason="(\w+)"\}$')
    return {f"{m.group(1)}/{m.group(2)}": value for name, value in scrape_metrics(port).items()
            if (m := pat.match(name))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/tiny")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", default="uniform:64:256")
    p.add_argument("--output-len", default="uniform:16:48")
    p.add_argument("--sessions", type=int, default=0)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument("--transport", default="tcp", choices=["tcp", "nixl", "auto"])
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma separated, of {', '.join(MODES)}")
    p.add_argument("--baseline", default="colocated_2_router", help="mode the ratios divide by")
    p.add_argument("--min-uncached-tokens", type=int, default=256, help="conditional_1p1d's threshold")
    p.add_argument("--json", default="bench/results/cluster-cpu.json")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        for mode in modes:
            results[mode] = run_mode(mode, args, Path(tmp))
    for name, summary in results.items():
        print(format_table(summary, title=f"== {name}"))
        print()
    base = results.get(args.baseline)
    ratios = {}
    for mode, d in results.items():
        if base is None or mode == args.baseline:
            continue
        r = {f"{m}_p50": d[m]["p50"] / base[m]["p50"] if base[m]["p50"] else None
             for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")}
        r["throughput"] = (d["output_token_throughput"] / base["output_token_throughput"]
                           if base["output_token_throughput"] else None)
        ratios[f"{mode}_over_{args.baseline}"] = r
    print(f"ratios (mode / {args.baseline}):", json.dumps(ratios, indent=1))
    out = {"results": results, "ratios": ratios, "args": vars(args),
           "host": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
