"""``pdserve scale prefill|decode N [--run-dir DIR]``: resize one pool of a running cluster.

The request goes to the `pdserve up` controller through its run directory; it starts or drains
workers and updates the router's membership while requests keep flowing. Returns once applied.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("scale", help="resize the prefill or decode pool of a running cluster")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("n", type=int)
    p.add_argument("--run-dir", default=".run/cluster")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "state.json").exists():
        print(f"pdserve scale: no running cluster at {run_dir}", file=sys.stderr)
        return 1
    if args.n < 1:
        print("pdserve scale: N must be >= 1", file=sys.stderr)
        return 2
    rid = uuid.uuid4().hex[:8]
    tmp = run_dir / f"scale-request.{rid}.tmp"
    tmp.write_text(json.dumps({"role": args.role, "n": args.n, "id": rid}))
    os.replace(tmp, run_dir / "scale-request.json")
    done = run_dir / f"scale-done-{rid}"
    deadline = time.monotonic() + args.timeout
    while not done.exists():
        if time.monotonic() > deadline:
            print("pdserve scale: timed out waiting for the controller", file=sys.stderr)
            return 1
        time.sleep(0.2)
    result = done.read_text()
    done.unlink()
    if result != "ok":
        print(f"pdserve scale: {result}", file=sys.stderr)
        return 1
    state = json.loads((run_dir / "state.json").read_text())
    n = sum(1 for w in state["workers"] if w["role"] == args.role)
    print(f"{args.role} pool now has {n} workers")
    return 0
