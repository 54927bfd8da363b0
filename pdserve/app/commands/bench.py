"""``pdserve bench``: open-loop Poisson load against a router, one rate or a goodput-frontier sweep.

One rate (``--router HOST:PORT --rate R --num-requests N``): a table of TTFT / ITL / TPOT / E2E
percentiles, throughput and goodput, the same as JSON with ``--json OUT``. ``--sessions K --turns T``
runs K multi-turn conversations instead; the table adds KV bytes sent, the prompt-cache hit ratio (vs
shipping every block) and requests per decode worker.

Sweep (``--sweep --rates 2,4,8``): rates in order until SLO attainment (requests within
``--ttft-slo-ms`` and ``--tpot-slo-ms``, of all sent) falls under ``--stop-below``; reports the SLO
goodput (highest rate with attainment >= ``--target``), p50/p90/p99 TTFT and ITL per rate, JSON, and a
PNG of p90 TTFT and ITL against rate (``--plot``, default next to ``--json``). Against ``--router`` it
sweeps that cluster; with ``--model DIR --modes 1p1d-nixl,1p1d-tcp,conditional,colocated`` it starts
each mode itself, one after the other on this host (``--gpus N``), and compares them side by side.

Sessions side by side (``--model DIR --modes M1,M2 --sessions K --turns T``, no ``--sweep``): each
configuration started in turn and sent the same seeded conversations, ``--think-time`` seconds (mean)
between an answer and the next turn; the table compares the returning turns' reuse (any tier, device
cache only, from the host/disk tiers), prompt tokens computed per turn, TTFT and TPOT. ``MODE@TAG``
adds ``--variant TAG=FLAGS`` to every process of that mode (e.g. KV tiers off against on).

Lengths: ``--input-len`` / ``--output-len`` take N, uniform:LO:HI, normal:MEAN:STD or
lognormal:MEDIAN:SIGMA[:LO:HI]; ``--trace FILE`` replays a JSONL trace of (input, output) lengths.
Never fails on a timing; exits 1 only when every request failed (one rate) or no mode ran (sweep).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="Poisson load generator for a router; --sweep: goodput frontier")
    p.add_argument("--router", help="HOST:PORT of a running router (or colocated server); with --backend "
                   "openai, of its HTTP door")
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="grpc (default) or openai: the router's OpenAI-compatible HTTP door")
    p.add_argument("--api-key", default="", help="--backend openai: the router's API key")
    p.add_argument("--rate", type=float, default=float("inf"), help="requests (or sessions) per second")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", default="128",
                   help="N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA[:LO:HI]")
    p.add_argument("--output-len", default="32")
    p.add_argument("--trace", help="JSONL of {\"input\": N, \"output\": M} lengths, replayed in order")
    p.add_argument("--sessions", type=int, default=0, help="multi-turn: number of sessions")
    p.add_argument("--turns", type=int, default=1, help="multi-turn: turns per session")
    p.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="multi-turn: mean seconds (exponential) between an answer and the session's next "
                        "turn")
    p.add_argument("--variant", action="append", default=[], metavar="TAG=FLAGS",
                   help="with --model: the flags a MODE@TAG adds to every process of that mode (repeatable), "
                        "e.g. \"tiers=--kv-host-gb 1 --kv-disk-dir .run/kv --kv-disk-gb 8\"")
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts and arrivals are drawn from it: a second run with the same seed against the "
                        "same cluster sends the same prompts, which its prefix cache then serves without "
                        "prefill; give each rate point of a sweep its own seed (--sweep does)")
    p.add_argument("--system-prompt-len", type=int, default=0,
                   help="tokens of one shared prefix prepended to every request / session")
    p.add_argument("--block-size", type=int, default=16, help="workers' KV block size (for the KV report)")
    p.add_argument("--ttft-slo-ms", type=float)
    p.add_argument("--tpot-slo-ms", type=float)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline (s)")
    p.add_argument("--label", default="", help="name of this run in the table / JSON")
    p.add_argument("--json", help="write the summary JSON here")
    p.add_argument("--tls-dir", help="TLS: verify the router against DIR/ca.crt (and present DIR/client.crt)")
    s = p.add_argument_group("sweep (--sweep)")
    s.add_argument("--sweep", action="store_true", help="rate sweep: the goodput frontier")
    s.add_argument("--rates", default="geom:1:1.5:8", help="2,4,8 or geom:START:FACTOR:COUNT")
    s.add_argument("--seconds-per-rate", type=float, default=20.0, help="seconds of arrivals per rate point")
    s.add_argument("--min-requests", type=int, default=8, help="at least this many requests per point")
    s.add_argument("--target", type=float, default=0.95, help="SLO attainment that defines SLO goodput")
    s.add_argument("--stop-below", type=float, help="stop after a point under this attainment (default: "
                   "--target)")
    s.add_argument("--overload-factor", type=float, default=0.0,
                   help="also run one point at this multiple of each mode's SLO-goodput rate (e.g. 1.5)")
    s.add_argument("--plot", help="PNG path (default: --json with .png)")
    s.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="progress bar")
    s.add_argument("--model", help="start the clusters: model directory")
    s.add_argument("--modes", default="1p1d-tcp,conditional,colocated",
                   help="with --model: 1p1d | 1p1d-nixl | 1p1d-tcp | 1p1d-oneshot | conditional | "
                        "colocated | colocated-chunk512, comma separated")
    s.add_argument("--baseline", default="colocated", help="mode the frontier ratios divide by")
    s.add_argument("--gpus", type=int, default=0,
                   help="with --model: GPUs to spread the workers over (0: CPU)")
    s.add_argument("--colocated-workers", type=int, default=2)
    s.add_argument("--transport", default="tcp", choices=("auto", "nixl", "tcp"),
                   help="KV transport of 1p1d and conditional")
    s.add_argument("--worker-args", default="", help="extra serve flags of every worker (one string)")
    s.add_argument("--prefill-args", default="", help="extra serve flags of the prefill pool")
    s.add_argument("--router-args", default="", help="extra router flags of every mode (admission control)")
    s.add_argument("--run-dir", default=".run/bench-sweep", help="with --model: logs of each mode")
    p.set_defaults(func=_run)


def _base_config(args: argparse.Namespace, router: str):
    from pdserve.app.loadgen.dist import load_trace, parse_dist
    from pdserve.app.loadgen.runner import RunConfig

    return RunConfig(router=router, rate=args.rate, num_requests=args.num_requests,
                     input_len=parse_dist(args.input_len), output_len=parse_dist(args.output_len),
                     sessions=args.sessions, turns=args.turns, vocab_size=args.vocab_size, seed=args.seed,
                     timeout_s=args.timeout, system_prompt_len=args.system_prompt_len,
                     trace=load_trace(args.trace) if args.trace else (), backend=args.backend,
                     api_key=args.api_key, think_time_s=args.think_time)


def _run(args: argparse.Namespace) -> int:
    if args.tls_dir:
        from pdserve.client import set_default_tls

        set_default_tls(args.tls_dir)
    try:
        if args.sweep:
            return _sweep(args)
        if args.model:
            return _sessions_side_by_side(args)
        if not args.router:
            raise ValueError("--router HOST:PORT is required (or --sweep --model DIR to start clusters)")
        cfg = _base_config(args, args.router)
    except (ValueError, OSError) as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    from pdserve import event_loop
    from pdserve.app.loadgen import cpu
    from pdserve.app.loadgen.runner import run
    from pdserve.app.loadgen.stats import format_table, summarize

    cpu_before = cpu.try_read(args.router, backend=args.backend, api_key=args.api_key)
    samples, duration = event_loop.run(run(cfg))
    cpu_after = cpu.try_read(args.router, backend=args.backend, api_key=args.api_key)
    summary = summarize(samples, duration, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                        block_size=args.block_size)
    summary["config"] = {"router": args.router, "rate": args.rate, "num_requests": args.num_requests,
                         "input_len": args.input_len, "output_len": args.output_len, "trace": args.trace,
                         "sessions": args.sessions, "system_prompt_len": args.system_prompt_len,
                         "turns": args.turns, "seed": args.seed, "label": args.label}
    print(format_table(summary, title=args.label or f"pdserve bench {args.router}"))
    if cpu_before and cpu_after:  # each process's own CPU over the load (pdserve/app/loadgen/cpu.py)
        summary["cpu"] = cpu.report(cpu_before, cpu_after, summary)
        print(cpu.format_table(summary["cpu"]))
    _write_json(args.json, summary)
    return 0 if summary["num_ok"] else 1


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=float) + "\n")


def _variants(args: argparse.Namespace) -> tuple[tuple[str, tuple[str, ...]], ...]:
    out = []
    for item in args.variant:
        tag, sep, flags = item.partition("=")
        if not sep or not tag:
            raise ValueError(f"--variant wants TAG=FLAGS, got {item!r}")
        out.append((tag, tuple(shlex.split(flags))))
    return tuple(out)


def _mode_options(args: argparse.Namespace):
    from pdserve.app.loadgen.modes import ModeOptions

    return ModeOptions(model=args.model, gpus=args.gpus, colocated_workers=args.colocated_workers,
                       transport=args.transport, worker_args=tuple(shlex.split(args.worker_args)),
                       prefill_args=tuple(shlex.split(args.prefill_args)),
                       router_args=tuple(shlex.split(args.router_args)), variants=_variants(args))


def _sessions_side_by_side(args: argparse.Namespace) -> int:
    from pdserve.app.loadgen.modes import check_modes
    from pdserve.app.loadgen.turns import format_turns, run_turns

    if args.sessions < 1 or args.turns < 2:
        raise ValueError("--model without --sweep compares multi-turn sessions: give --sessions K --turns T "
                         "(T >= 2)")
    modes = [m for m in args.modes.split(",") if m]
    check_modes(modes)
    results = run_turns(modes, _mode_options(args), _base_config(args, ""), run_dir=args.run_dir,
                        block_size=args.block_size)
    print(format_turns(results))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    _write_json(args.json, {"results": results, "config": config,
                            "command": shlex.join(["pdserve", *sys.argv[1:]]) if sys.argv else "",
                            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return 0 if any(r.get("num_ok") for r in results.values()) else 1


def _sweep(args: argparse.Namespace) -> int:
    from pdserve.app.loadgen.compare import frontier_summary, run_modes
    from pdserve.app.loadgen.modes import check_modes
    from pdserve.app.loadgen.sweep import SweepConfig, parse_rates, sweep, table

    if bool(args.router) == bool(args.model):
        raise ValueError("--sweep needs either --router HOST:PORT (one running cluster) or --model DIR "
                         "(start each of --modes)")
    cfg = SweepConfig(rates=parse_rates(args.rates), seconds_per_rate=args.seconds_per_rate,
                      min_requests=args.min_requests, target=args.target,
                      stop_below=args.target if args.stop_below is None else args.stop_below,
                      ttft_slo_ms=args.ttft_slo_ms or 2000.0, tpot_slo_ms=args.tpot_slo_ms or 25.0,
                      overload_factor=args.overload_factor, label=args.label or "sweep")
    base = _base_config(args, args.router or "")
    progress = {"auto": None, "on": True, "off": False}[args.progress]
    if args.router:
        name = args.label or args.router
        results = {name: sweep(base, cfg, desc=name, progress=progress)}
    else:
        modes = [m for m in args.modes.split(",") if m]
        check_modes(modes)
        opts = _mode_options(args)
        results = run_modes(modes, opts, base, cfg, run_dir=args.run_dir, progress=progress)
    print(table(results))
    from pdserve.app.loadgen.cpu import format_sweep

    if cpu_text := format_sweep(results):
        print(f"\nCPU (each process's own, over each point)\n{cpu_text}")
    out = {"results": results, "frontier": frontier_summary(results, args.baseline),
           "config": {k: v for k, v in vars(args).items() if k != "func"},
           "command": shlex.join(["pdserve", *sys.argv[1:]]) if sys.argv else "",
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        from pdserve.app.loadgen.plot import plot_frontier

        try:
            out["plot"] = str(plot_frontier(results, plot, title=args.label or "goodput frontier"))
        except ImportError as exc:  # the numbers matter more than the picture
            out["plot_error"] = str(exc)
            print(f"pdserve bench: no plot: {exc}", file=sys.stderr)
    _write_json(args.json, out)
    if args.json:
        print(f"wrote {args.json}" + (f" and {out['plot']}" if "plot" in out else ""))
    return 0 if any("points" in r for r in results.values()) else 1
