"""Where a GPU worker's imports go: ``python -X importtime`` of the modules a worker loads before serving.

Each line of ``--imports`` is imported in a fresh interpreter, twice (the first warms the page cache),
with ``-X importtime``; the second run's table is parsed and the modules with the largest cumulative
time printed (nested imports indented by depth), beside the wall time of the whole command. The boot
report (docs/gpu.md "Boot") puts ``import torch`` and ``import flashinfer`` at most of a worker's start.

    python -m bench.import_profile --out DIR      (bash bench/device_run.sh imports)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = ["torch", "torch;flashinfer", "torch;triton",
           "torch;engine.attention.flashinfer_backend;flashinfer", "pdserve.app.cli"]


def _run(stmt: str) -> tuple[float, list[dict]]:
    code = "; ".join(f"import {m}" for m in stmt.split(";"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cum_us, name = _fields(line)
        rows.append({"self_us": self_us, "cum_us": cum_us, "depth": (len(name) - len(name.lstrip())) // 2,
                     "module": name.strip()})
    if proc.returncode:
        print(proc.stderr[-2000:])
    return wall, rows


def _fields(line: str) -> tuple[int, int, str]:
    """``import time: SELF | CUMULATIVE | NAME`` (NAME indented two spaces per nesting level)."""
    head, cum, name = line.split("|", 2)
    return int(head.split(":", 1)[1]), int(cum), name.rstrip()[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--imports", default=",".join(DEFAULT),
                    help="comma-separated; ';' joins the modules of one run")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    report = []
    for stmt in args.imports.split(","):
        _run(stmt)
        wall, rows = _run(stmt)
        top = sorted(rows, key=lambda r: -r["cum_us"])[: args.top]
        print(f"\n== import {stmt}: {wall:.2f} s wall (interpreter included)")
        for r in sorted(top, key=lambda r: rows.index(r)):
            print(f"  {r['cum_us'] / 1e3:8.1f} ms  {'  ' * r['depth']}{r['module']}")
        report.append({"imports": stmt, "wall_s": round(wall, 3), "top": top})
    Path(args.out, "import-profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
