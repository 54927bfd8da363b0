"""What each thread of a process was doing, from ``py-spy record --threads --idle [--native] -f raw``.

    python3 bench/pyspy_threads.py OUT/pyspy-decode.txt [OUT/pyspy-prefill.txt ...] [--top 6] [--json F]

Threads are grouped by name with a trailing pool index dropped (``kvtransfer-recv_3`` and
``kvtransfer-recv_7`` are one group). Per group: its samples (with ``--idle`` every thread is sampled
every time, so a group's count over the interval's samples is how many of its threads there were), and
the most frequent innermost frames (a native frame names its library: ``sendmsg (libc.so.6)``, a
Python frame its file and line), each with its share of the group's samples; beside each, the innermost
frame of this project's own code above it (what called into the library), so "the loop thread waits in
``cudaHostAlloc`` under ``KVMemory._host_buffer``" reads off one line.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

_THREAD = re.compile(r"^thread \(0x[0-9a-fA-F]+\): |^thread \(\d+\): ")
_OURS = ("kvtransfer/", "engine/", "decode_service/", "prefill_service/", "router/", "pdserve/")


def group_of(name: str) -> str:
    return re.sub(r"[_-]\d+$", "", name)


def our_frame(frames: list[str]) -> str:
    for f in reversed(frames):
        m = re.search(r"\(([^():]+):\d+\)$", f)
        if m and any(p in m.group(1) for p in _OURS):
            return f
    return "-"


def parse(path: Path) -> dict[str, dict]:
    """group -> {samples, threads, leaves: Counter[(leaf, ours)]}"""
    out: dict[str, dict] = defaultdict(lambda: {"samples": 0, "threads": set(), "leaves": Counter()})
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        m = _THREAD.match(stack)
        body = stack[m.end():] if m else stack
        frames = body.split(";")
        name, frames = frames[0], frames[1:]
        g = out[group_of(name)]
        g["samples"] += int(count)
        g["threads"].add(stack[:m.end()] if m else name)
        leaf = frames[-1] if frames else "(no frames)"
        g["leaves"][(leaf, our_frame(frames))] += int(count)
    return out


def summary(path: Path, top: int) -> dict:
    groups = parse(path)
    res = {}
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["samples"]):
        n = g["samples"]
        res[name] = {"threads": len(g["threads"]), "samples": n,
                     "top": [{"leaf": leaf, "ours": ours, "share": round(c / n, 3)}
                             for (leaf, ours), c in g["leaves"].most_common(top)]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    everything = {}
    for f in args.files:
        res = everything[f.name] = summary(f, args.top)
        print(f"== {f.name}")
        for name, g in res.items():
            print(f"  {name} ({g['threads']} threads, {g['samples']} samples)")
            for t in g["top"]:
                print(f"    {t['share']:6.1%}  {t['leaf'][:70]:70s}  <- {t['ours'][:80]}")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
