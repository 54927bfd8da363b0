"""Where TCP KV transfers' frame time goes, from ``kvtrace tx-frames`` / ``rx-frames`` log lines.

    python3 bench/kvtrace_frames.py LOG [LOG ...] [--json OUT.json]

A transport with ``TransportConfig.trace`` (``PDSERVE_KV_TRACE=1``; ``bench.kv_bench --variant
traced=trace=true``) logs, per TCP send, the sum over its DATA frames of the seconds waiting for
staging, for a free lane and in the lane, and per expectation the sum over its thread-read frames of
dispatch-to-done, thread, poll and between-frame gap seconds (kvtransfer/trace.py). This groups the
lines by request id less its trailing numbers (kv_bench names requests ``<row>-c<conc>-<round>-<i>``)
and prints each group's mean per transfer: the table the ``kv-trace`` step of bench/device_run.sh shows.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

LINE = re.compile(r"kvtrace (tx-frames|rx-frames) (\S+) (\{.*\})")


def summarise(paths: list[Path]) -> dict[str, dict[str, dict[str, float]]]:
    sums: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    counts: dict = collections.defaultdict(collections.Counter)
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            m = LINE.search(line)
            if not m:
                continue
            side, rid, fields = m.group(1), m.group(2), json.loads(m.group(3))
            group = re.sub(r"(-\d+)+$", "", rid)
            sums[group][side].update(fields)
            counts[group][side] += 1
    out: dict = {}
    for group, sides in sorted(sums.items()):
        for side, fields in sides.items():
            n = counts[group][side]
            means = {k: round(v / n, 5) for k, v in fields.items()}
            out.setdefault(group, {})[side] = {"transfers": n, **means}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = summarise(args.logs)
    for group, sides in out.items():
        for side, fields in sides.items():
            print(f"{group:<16} {side:<10} " + "  ".join(f"{k} {v}" for k, v in fields.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
