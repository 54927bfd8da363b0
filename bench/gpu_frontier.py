"""The goodput frontier on 2 GPUs, llama3-8b shape, a log-normal mixed workload: 1P1D over NIXL, 1P1D
over TCP, conditional 1P1D and 2 colocated workers side by side, each behind one router with admission
control on, then each at 1.5x its own SLO-goodput rate.

    bash bench/device_run.sh frontier -- --size small        # ~8 minutes of device time
    python3 bench/gpu_frontier.py --out DIR --size small [--modes ...] [--dry-run]
    bash bench/device_run.sh frontier -- --modes 1p1d-tcp,1p1d-tcp@nochain \
        --variant nochain="--kv-rx-chain off"   # a mode beside a variant of itself
    bash bench/device_run.sh frontier -- --modes 1p1d-nixl,1p1d-tcp --rates 6,10,14 --stop-below 0 \
        --overload-factor 0 --tag tcp   # TCP at NIXL's rates, every rate swept

Workload (issue 15): prompts log-normal, median 2048 tokens, sigma 0.8, clipped to 256..8192; outputs
uniform 64..384; Poisson arrivals; ignore_eos; every rate point its own prompts, the same in every mode.
SLOs: TTFT <= 2 s, TPOT <= 25 ms; SLO goodput = the highest rate at which >= 95% of requests meet both.
The prefill pool is compute-tuned (``--max-num-batched-tokens 8192``), every other flag the engine's
default; the router of every mode runs ``--max-queue-wait-s`` (default 1.5 s: the TTFT target less a
long prompt's prefill), so past capacity it refuses rather than queues.

Per mode: the sweep (``pdserve.app.loadgen.sweep``: p50/p90/p99 TTFT and ITL per rate, attainment,
sheds), the overload point (errors other than RESOURCE_EXHAUSTED, TTFT p90 of the admitted requests,
goodput over the mode's peak), whether every KV block came back afterwards, and what each rate point
cost in CPU (router, prefill, decode: cores, per request and per output token, and the cluster's
cores per 1k output tokens/s, read from the processes themselves). On one GPU a 1P1D mode's two
workers share it (each with half the KV memory); colocated is then one worker. Sizes trade GPU time
for resolution: ``small`` 4 rates x 8 s, ``medium`` 6 x 12 s, ``full`` the issue's 20 s per rate.
Writes ``gpu-frontier-<device>-<date>[-TAG].{json,md,png}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODES = ("1p1d-nixl", "1p1d-tcp", "conditional", "colocated")
INPUT_LEN, OUTPUT_LEN = "lognormal:2048:0.8:256:8192", "uniform:64:384"
SLO = {"ttft_slo_ms": 2000.0, "tpot_slo_ms": 25.0}
SIZES = {  # rates over both GPUs (req/s), seconds of arrivals per rate, device-time budget of the sweeps
    "small": ((6.0, 10.0, 14.0, 18.0), 8.0, 380.0),
    "medium": ((4.0, 7.0, 10.0, 13.0, 16.0, 19.0), 12.0, 900.0),
    "full": ((4.0, 7.0, 10.0, 13.0, 16.0, 19.0, 22.0), 20.0, 1800.0),
}


def plan(args: argparse.Namespace, model: str, n_gpus: int, kv_gb: float) -> tuple[list[str], object, object]:
    """(modes, ModeOptions, SweepConfig) of this run (no GPU needed)."""
    from gpu_disagg import mode_options

    from pdserve.app.loadgen.sweep import SweepConfig

    rates, secs, _ = SIZES[args.size]
    if args.rates:
        rates = tuple(float(r) for r in args.rates.split(",") if r)
    modes = [m for m in args.modes.split(",") if m]
    opts = mode_options(model, n_gpus=n_gpus, kv_gb=kv_gb, transport="nixl",
                        router_args=("--max-queue-wait-s", str(args.max_queue_wait_s)))
    variants = tuple((tag, tuple(shlex.split(flags)))
                     for tag, _, flags in (v.partition("=") for v in getattr(args, "variant", ())))
    opts = dataclasses.replace(opts, variants=variants)
    cfg = SweepConfig(rates=tuple(rates), seconds_per_rate=secs, min_requests=16, target=0.95,
                      stop_below=args.stop_below, overload_factor=args.overload_factor,
                      label="frontier-lognormal",
                      **SLO)
    return modes, opts, cfg


def markdown(res: dict) -> list[str]:
    from pdserve.app.loadgen.cpu import format_sweep
    from pdserve.app.loadgen.sweep import table

    f = res["frontier"]
    rows = [f"# Goodput frontier: {res['device']['name']} x{res['device']['count']}", "",
            f"command: `{res['command']}`, date {res['date']}", "",
            f"workload: input {INPUT_LEN}, output {OUTPUT_LEN}, Poisson, ignore_eos; SLO TTFT <= "
            f"{SLO['ttft_slo_ms']:.0f} ms, TPOT <= {SLO['tpot_slo_ms']:.0f} ms; size {res['size']}", "",
            "```", table(res["results"]), "```", "",
            "| mode | SLO goodput req/s | vs colocated | peak within SLO req/s | rates below colocated "
            "| overload rate | errors (not shed) | shed | TTFT p90 admitted ms | goodput / peak "
            "| blocks back |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for mode, r in f["modes"].items():
        o = r.get("overload") or {}
        ratio = r.get("slo_goodput_over_baseline")
        cells = [mode, f"{r['slo_goodput_rps']:g}", "-" if ratio is None else f"{ratio:.2f}x",
                 f"{r['peak_goodput_rps']:.2f}", str(r.get("rates_below_baseline", "-"))]
        if o:
            cells += [f"{o['rate']:g}", str(o["errors_not_shed"]), str(o["shed"]),
                      f"{o['ttft_p90_admitted_ms']:.0f}", f"{o['goodput_over_peak']:.2f}"]
        else:
            cells += ["-"] * 5
        rows.append("| " + " | ".join([*cells, str(r["blocks_back"])]) + " |")
    for mode, r in res["results"].items():
        if "error" in r:
            rows.append(f"\n{mode}: {r['error']}")
    if cpu_text := format_sweep(res["results"]):
        rows += ["", "CPU per rate point (each process's own CPU seconds over the point):", "",
                 "```", cpu_text, "```"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--size", choices=tuple(SIZES), default="small")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-queue-wait-s", type=float, default=1.5, help="every mode's router")
    ap.add_argument("--overload-factor", type=float, default=1.5)
    ap.add_argument("--rates", default="", help="req/s, e.g. 6,10,14 (default: the size's)")
    ap.add_argument("--stop-below", type=float, default=0.95,
                    help="a mode stops at the first rate under this SLO attainment (0: sweep every rate, "
                         "e.g. to see whether TCP fails requests up to NIXL's goodput rate)")
    ap.add_argument("--budget-s", type=float, help="device time for the sweeps (default: the size's)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--variant", action="append", default=[], metavar="TAG=FLAGS",
                    help="flags every worker of a MODE@TAG gets, e.g. --modes 1p1d-tcp,1p1d-tcp@nochain "
                         "--variant nochain='--kv-rx-chain off' (repeatable)")
    ap.add_argument("--kv-gb", type=float, default=0.0,
                    help="KV cache per worker (default: what the GPU holds beside the model; one GPU: half)")
    ap.add_argument("--dry-run", action="store_true", help="print the clusters and rate points; no GPU")
    args = ap.parse_args(argv)
    if args.dry_run:
        from pdserve.app.loadgen.modes import cluster_spec, describe

        modes, opts, cfg = plan(args, "MODEL", int(os.environ.get("PDSERVE_DRY_RUN_GPUS", "2")), 30.0)
        print(json.dumps({"modes": describe({m: cluster_spec(m, opts) for m in modes}),
                          "rates": cfg.rates, "requests": [cfg.requests_at(r) for r in cfg.rates],
                          "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "slo": SLO}, indent=1))
        return 0

    import torch
    from gpu import machine
    from gpu_disagg import BENCH_ENV, kv_memory_gb, write_checkpoint

    from pdserve.app.loadgen.compare import frontier_summary, run_modes
    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.plot import plot_frontier
    from pdserve.app.loadgen.runner import RunConfig
    from pdserve.settings import bench_command

    t0 = time.monotonic()
    info = machine()
    shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > (40 << 30)
    root = "/dev/shm" if shm else "/tmp"  # RAM-backed when it has room for 16 GB
    model = write_checkpoint(Path(os.environ.get("PDSERVE_BENCH_MODEL_DIR", f"{root}/pdserve-llama3-8b")),
                             "llama3-8b")
    n_gpus = torch.cuda.device_count()
    # On one GPU a 1P1D cluster's two workers share it: each gets half of what one worker may hold.
    kv_gb = args.kv_gb or kv_memory_gb("llama3-8b", workers_per_gpu=1 if n_gpus >= 2 else 2)
    modes, opts, cfg = plan(args, str(model), n_gpus, kv_gb)
    base = RunConfig(router="", rate=1.0, num_requests=1, input_len=parse_dist(INPUT_LEN),
                     output_len=parse_dist(OUTPUT_LEN), vocab_size=1000, timeout_s=120.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu-frontier-{info['slug']}-{dt.date.today().isoformat()}" + (f"-{args.tag}" if args.tag else "")
    res = {"device": info, "command": bench_command(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "size": args.size, "slo": SLO,
           "workload": {"input_len": INPUT_LEN, "output_len": OUTPUT_LEN},
           "router_args": list(opts.router_args), "kv_gb_per_worker": kv_gb,
           "checkpoint_s": time.monotonic() - t0, "results": {}}

    def save(mode: str | None = None, r: dict | None = None) -> None:
        if mode is not None:
            res["results"][mode] = r
        res["frontier"] = frontier_summary(res["results"], "colocated")
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float) + "\n")

    budget = args.budget_s if args.budget_s is not None else SIZES[args.size][2]
    run_modes(modes, opts, base, cfg, run_dir=out / "frontier-logs", env=dict(BENCH_ENV), progress=False,
              warm_input_lens=(64, 2048, 8000), budget_s=budget, on_mode=save)
    save()
    try:
        title = f"llama3-8b, {INPUT_LEN} in / {OUTPUT_LEN} out, {info['name']}"
        res["plot"] = str(plot_frontier(res["results"], out / f"{name}.png", title=title))
    except Exception as exc:  # the numbers matter more than the picture
        res["plot_error"] = repr(exc)
    save()
    text = "\n".join(markdown(res))
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / name}.{{json,md,png}} in {time.monotonic() - t0:.0f} s")
    return 0 if any("points" in r for r in res["results"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
