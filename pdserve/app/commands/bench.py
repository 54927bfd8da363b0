"""``pdserve bench --router HOST:PORT --rate R --num-requests N --input-len DIST --output-len DIST``.

Open-loop Poisson load against a router (or a colocated server: same API). Prints a table of
TTFT / ITL / TPOT / E2E percentiles, throughput and goodput, and writes the same as JSON with
``--json OUT``. DIST is ``N``, ``uniform:LO:HI`` or ``normal:MEAN:STD``. ``--sessions K --turns T``
runs K multi-turn conversations instead; the table adds KV bytes sent, the prompt-cache hit
ratio (vs shipping every block) and requests per decode worker. Never fails on a timing; exits 1
only when every request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="Poisson load generator for a router")
    p.add_argument("--router", required=True)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests (or sessions) per second")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", default="128", help="N | uniform:LO:HI | normal:MEAN:STD")
    p.add_argument("--output-len", default="32")
    p.add_argument("--sessions", type=int, default=0, help="multi-turn: number of sessions")
    p.add_argument("--turns", type=int, default=1, help="multi-turn: turns per session")
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts and arrivals are drawn from it: a second run with the same seed against the "
                        "same cluster sends the same prompts, which its prefix cache then serves without "
                        "prefill; give each rate point of a sweep its own seed")
    p.add_argument("--system-prompt-len", type=int, default=0,
                   help="tokens of one shared prefix prepended to every request / session")
    p.add_argument("--block-size", type=int, default=16, help="workers' KV block size (for the KV report)")
    p.add_argument("--ttft-slo-ms", type=float)
    p.add_argument("--tpot-slo-ms", type=float)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline (s)")
    p.add_argument("--label", default="", help="name of this run in the table / JSON")
    p.add_argument("--json", help="write the summary JSON here")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.runner import RunConfig, run
    from pdserve.app.loadgen.stats import format_table, summarize

    try:
        cfg = RunConfig(router=args.router, rate=args.rate, num_requests=args.num_requests,
                        input_len=parse_dist(args.input_len), output_len=parse_dist(args.output_len),
                        sessions=args.sessions, turns=args.turns, vocab_size=args.vocab_size, seed=args.seed,
                        timeout_s=args.timeout, system_prompt_len=args.system_prompt_len)
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    samples, duration = asyncio.run(run(cfg))
    summary = summarize(samples, duration, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                        block_size=args.block_size)
    summary["config"] = {"router": args.router, "rate": args.rate, "num_requests": args.num_requests,
                         "input_len": args.input_len, "output_len": args.output_len,
                         "sessions": args.sessions, "system_prompt_len": args.system_prompt_len,
                         "turns": args.turns, "seed": args.seed, "label": args.label}
    print(format_table(summary, title=args.label or f"pdserve bench {args.router}"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return 0 if summary["num_ok"] else 1
