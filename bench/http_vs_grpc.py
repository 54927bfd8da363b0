"""What the router's HTTP door costs over its gRPC door: router CPU per request and client latency.

    python -m bench.http_vs_grpc [--model DIR] [--requests 48] [--rounds 3] [--json OUT]

One 1P1D cluster (KV over TCP) with the HTTP door on; the same workload (``--requests`` requests at
once, ``--input-len`` prompt tokens, ``--output-len`` tokens each, prompts drawn from one seed per
round so both doors get identical prompts) is sent through gRPC (``pdserve.client.AsyncClient``) and
through HTTP (``pdserve bench --backend openai``'s client: streamed /v1/completions), alternating
door by door for ``--rounds`` rounds after a warm-up of each. Per run it reads the router process's
CPU time (user + system, /proc/PID/stat) before and after, less its idle rate (measured first) times
the run's duration, so "router CPU per request" is all the
router did for it: admission, placement, the gRPC calls to both workers, and for HTTP also parsing
the JSON body, SSE framing and uvicorn. The load generator runs in this process, not the router's.
Two loads: "serial" (one request at a time: the door's latency without queueing) and "burst" (every
request at once). Prints one table per load (per door: the median over rounds of router CPU ms per
request, TTFT p50, E2E p50, mean ITL, and the HTTP - gRPC differences and ratios) and writes every run
as JSON. Never fails on a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(cluster, backend: str, args, seed: int, load: str) -> dict:
    """``load`` "burst": every request at once; "serial": one after the other (latency without queueing)."""
    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.runner import RunConfig, run
    from pdserve.app.loadgen.stats import summarize

    address = cluster.http if backend == "openai" else cluster.router

    def config(n: int, s: int) -> RunConfig:
        return RunConfig(router=address, rate=float("inf"), num_requests=n,
                         input_len=parse_dist(str(args.input_len)),
                         output_len=parse_dist(str(args.output_len)), seed=s, backend=backend)

    pid = cluster.cluster.router.pid
    before, start = cpu_seconds(pid), time.perf_counter()
    if load == "burst":
        samples, duration = asyncio.run(run(config(args.requests, seed)))
    else:
        samples = []
        for i in range(args.requests):
            samples += asyncio.run(run(config(1, seed * 100_000 + i)))[0]
        duration = time.perf_counter() - start
    # the router's own background work (worker stats polls, uvicorn's tick) is not the requests' cost
    cpu = cpu_seconds(pid) - before - args.idle_cpu_per_s * duration
    s = summarize(samples, duration)
    return {"backend": backend, "load": load, "seed": seed, "ok": s["num_ok"], "requests": s["num_requests"],
            "router_cpu_ms_per_request": cpu * 1e3 / max(1, s["num_ok"]),
            "ttft_p50_ms": s["ttft_ms"]["p50"], "e2e_p50_ms": s["e2e_ms"]["p50"],
            "itl_mean_ms": s["itl_ms"]["mean"], "duration_s": duration}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: a tiny random checkpoint)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=5.0, help="router idle CPU is measured this long")
    p.add_argument("--json", default="bench/results/http-vs-grpc.json")
    args = p.parse_args(argv)
    args.idle_cpu_per_s = 0.0

    from pdserve.app.launcher.local import LocalCluster

    with tempfile.TemporaryDirectory(prefix="pdserve-http-bench-") as tmp:
        model = args.model
        if not model:
            from engine.checkpoint import preset_config, write_random_checkpoint

            model = str(write_random_checkpoint(Path(tmp) / "tiny", preset_config("tiny")))
        with LocalCluster(model, prefill=1, decode=1, transport="tcp", run_dir=Path(tmp) / "run",
                          worker_args=("--num-blocks", "1024"), http_port=free_port()) as cluster:
            for backend in ("grpc", "openai"):  # warm-up: connections, caches, first-call imports
                one_run(cluster, backend, args, seed=10_000, load="burst")
            pid, t0 = cluster.cluster.router.pid, time.perf_counter()
            c0 = cpu_seconds(pid)
            time.sleep(args.idle_seconds)
            args.idle_cpu_per_s = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
            print(f"router idle CPU: {args.idle_cpu_per_s * 1e3:.1f} ms/s (subtracted from every run)")
            rounds = []
            seed = 0
            for r in range(args.rounds):
                for load in ("serial", "burst"):
                    for backend in (("grpc", "openai") if r % 2 == 0 else ("openai", "grpc")):
                        seed += 1  # fresh prompts every run: no door is served from the other's cache
                        rounds.append(one_run(cluster, backend, args, seed=seed, load=load))
                        print(json.dumps(rounds[-1]), flush=True)
    keys = ("router_cpu_ms_per_request", "ttft_p50_ms", "e2e_p50_ms", "itl_mean_ms")
    def median(load: str, backend: str, key: str) -> float:
        return statistics.median(x[key] for x in rounds if x["backend"] == backend and x["load"] == load)

    med = {f"{load}/{b}": {k: median(load, b, k) for k in keys}
           for load in ("serial", "burst") for b in ("grpc", "openai")}
    for load in ("serial", "burst"):
        print(f"\n{load + ' (median of ' + str(args.rounds) + ' rounds)':<32}{'gRPC':>10}{'HTTP':>10}"
              f"{'HTTP-gRPC':>11}{'HTTP/gRPC':>11}")
        for k in keys:
            g, h = med[f"{load}/grpc"][k], med[f"{load}/openai"][k]
            print(f"{k:<32}{g:>10.2f}{h:>10.2f}{h - g:>11.2f}{h / g if g else float('nan'):>11.2f}")
    out = {"config": vars(args), "rounds": rounds, "median": med, "when": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
