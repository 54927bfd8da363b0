"""``pdserve top``: a live terminal view of a running cluster from the Prometheus metrics it exports.

Per process: the router's requests/s, requests in flight, TTFT and TPOT p50/p90, KV bytes/s and failures;
each worker's queue, running requests, KV blocks used, prompt and generated tokens/s, step time p50 and
prefix-cache hits by tier. ``pdserve/app/top/`` holds the computations (``stats``), the scraping
(``scrape``) and the drawing (``view``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("top", help="live view of a running cluster's metrics "
                                          "(pdserve up --metrics-port)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run-dir", default=None,
                     help="the cluster's run directory: its prometheus-targets.json lists every process "
                          "(default .run/cluster)")
    src.add_argument("--targets", default=None, metavar="HOST:PORT,...",
                     help="metrics addresses given by hand (each role read from its metrics)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S",
                   help="seconds between refreshes; with --once, between the two scrapes the rates come "
                        "from (0: one scrape, no rates, percentiles since start) (default 2)")
    p.add_argument("--timeout", type=float, default=2.0, metavar="S", help="per scrape (default 2)")
    p.add_argument("--once", action="store_true", help="print one table (or --json) and exit")
    p.add_argument("--json", action="store_true", help="with --once: the same numbers as one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve.app.top.scrape import Poller, run_dir_targets, targets_from_list
    from pdserve.app.top.stats import as_json

    if args.json and not args.once:
        print("pdserve top: --json needs --once", file=sys.stderr)
        return 2
    if args.interval < 0 or (args.interval == 0 and not args.once):
        print("pdserve top: --interval must be > 0 (0 only with --once)", file=sys.stderr)
        return 2
    if args.targets:
        targets = targets_from_list(args.targets)
        if not targets:
            print("pdserve top: --targets lists no address", file=sys.stderr)
            return 2
        source, read = args.targets, lambda: targets
    else:
        run_dir = Path(args.run_dir or ".run/cluster")
        read = run_dir_targets(run_dir)
        if not read():
            print(f"pdserve top: no targets in {run_dir}/prometheus-targets.json (was the cluster started "
                  "with `pdserve up --metrics-port P`?)", file=sys.stderr)
            return 1
        source = str(run_dir)
    poller = Poller(read, timeout=args.timeout)
    try:
        if not args.once:
            from pdserve.app.top.view import live
            return live(poller.poll, source, args.interval)
        rows = poller.poll()
        if args.interval > 0:
            time.sleep(args.interval)
            rows = poller.poll()
        if args.json:
            print(json.dumps(as_json(rows)))
        else:
            from rich.console import Console

            from pdserve.app.top.view import render
            console = Console()
            if not console.is_terminal:  # a pipe or a file: the whole table, not 80 columns of it
                console = Console(width=max(console.width, 200))
            console.print(render(rows, source, args.interval))
        return 0 if any(r.up for r in rows) else 1
    finally:
        poller.close()
