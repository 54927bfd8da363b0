"""``pdserve down [--run-dir DIR]``: stop the cluster that `pdserve up` runs (graceful drain)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("down", help="stop a cluster started by `pdserve up`")
    p.add_argument("--run-dir", default=".run/cluster")
    p.add_argument("--timeout", type=float, default=90.0)
    p.set_defaults(func=_run)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child its parent has not reaped yet still "exists": a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _run(args: argparse.Namespace) -> int:
    state_path = Path(args.run_dir) / "state.json"
    if not state_path.exists():
        print(f"pdserve down: no cluster state at {state_path}", file=sys.stderr)
        return 1
    state = json.loads(state_path.read_text())
    pid = int(state["pid"])
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        # The controller did not finish in time: stop what it started, by pid.
        for w in [*state.get("workers", []), {"pid": state.get("router_pid")}]:
            if w.get("pid") and _alive(int(w["pid"])):
                os.kill(int(w["pid"]), signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        print("pdserve down: controller did not stop in time; killed it and its workers", file=sys.stderr)
        state_path.unlink(missing_ok=True)
        return 1
    print("cluster stopped")
    return 0
