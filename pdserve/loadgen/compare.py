"""Disaggregated 1P1D vs colocated, side by side on this host: ``python -m pdserve.loadgen.compare``.

Starts a 1 prefill + 1 decode + router cluster (the `pdserve up --launcher process` code path) and
one colocated server on the same model, runs the same `pdserve bench` workload against each (same
seed, so the same prompts and arrival times), prints both tables plus ratios and writes one JSON.
Timings are only meaningful as ratios taken in one run on one machine; nothing here asserts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

from pdserve.launcher.local import LocalCluster, colocated
from pdserve.loadgen.dist import parse_dist
from pdserve.loadgen.runner import RunConfig, run
from pdserve.loadgen.stats import format_table, summarize


def bench(router: str, args: argparse.Namespace) -> dict:
    cfg = RunConfig(router=router, rate=args.rate, num_requests=args.num_requests,
                    input_len=parse_dist(args.input_len), output_len=parse_dist(args.output_len),
                    sessions=args.sessions, turns=args.turns, vocab_size=args.vocab_size, seed=args.seed)
    asyncio.run(run(RunConfig(router=router, rate=float("inf"), num_requests=2, input_len=parse_dist("8"),
                              output_len=parse_dist("2"), vocab_size=args.vocab_size)))  # warm-up
    samples, duration = asyncio.run(run(cfg))
    return summarize(samples, duration, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms)


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
    p.add_argument("--json", default="bench/results/cluster-cpu.json")
    args = p.parse_args(argv)
    worker_args = ("--num-blocks", str(args.num_blocks))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        with LocalCluster(args.model, prefill=1, decode=1, transport=args.transport, run_dir=Path(tmp) / "pd",
                          worker_args=worker_args, policy="prefix") as c:
            results["disaggregated_1p1d"] = bench(c.router, args)
        proc = colocated(args.model, log_path=Path(tmp) / "colocated.log", args=worker_args)
        try:
            results["colocated"] = bench(proc.address, args)
        finally:
            proc.stop(30)
    for name, summary in results.items():
        print(format_table(summary, title=f"== {name}"))
        print()
    d, c = results["disaggregated_1p1d"], results["colocated"]
    ratios = {f"{m}_p50_pd_over_colocated": d[m]["p50"] / c[m]["p50"] if c[m]["p50"] else None
              for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")}
    ratios["throughput_pd_over_colocated"] = (d["output_token_throughput"] / c["output_token_throughput"]
                                              if c["output_token_throughput"] else None)
    print("ratios (disaggregated / colocated):", json.dumps(ratios, indent=1))
    out = {"results": results, "ratios": ratios, "args": vars(args),
           "host": {"platform": platform.platform(), "python": platform.python_version()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
