"""Where a live cluster's KV acknowledgement time goes, from the workers' PDSERVE_KV_TRACE=1 logs.

    python3 bench/kvtrace_report.py LOG_DIR [LOG_DIR ...] [--json OUT.json] [--min-compute-ms 80]

LOG_DIR holds the workers' logs of one run (``disagg-logs/<mode>/logs`` in a ``bench/device_run.sh``
bundle). Each remotely prefilled request has three lines there (kvtransfer/trace.py): the prefill
worker's (called, first_step, prefill_done, acked), the sender's (start ... acked) and the receiver's
(expect, begin, wrote, complete), all ``time.monotonic()`` of one host. Per request, after the prefill
was done: ``kv_wait`` (prefill done -> the worker saw the ack), ``posted`` (-> last WRITE posted),
``back`` (receiver complete -> sender saw DONE), ``seen`` (sender's ack -> the prefill coroutine ran),
and ``begin_ok`` (BEGIN sent -> BEGIN_OK handled). Only prompts whose compute took at least
``--min-compute-ms`` (the long-prompt workload) are counted. Also counts the stall watch's
"event loop stuck" lines (pdserve/stall_watch.py) and their durations when the logs have them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

STAGES = ("kv_wait", "posted", "back", "seen", "begin_ok")


def load(log_dir: Path) -> dict[str, dict]:
    """{request id: {side: timeline}} from every log in ``log_dir``. A transfer's id carries its attempt
    (``<request>/<n>``, the router's migration retries); it is filed under the request's id, so the
    prefill worker's line and both transfer lines meet (a later attempt's line replaces an earlier)."""
    out: dict[str, dict] = {}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"kvtrace ([\w-]+) (\S+) (\{.*\})", line)
            if m:
                out.setdefault(m.group(2).split("/")[0], {})[m.group(1)] = json.loads(m.group(3))
    return out


def stages(traces: dict[str, dict], min_compute_s: float) -> list[dict]:
    rows = []
    for x in traces.values():
        if not all(k in x for k in ("tx", "rx", "prefill")):
            continue
        p, t, r = x["prefill"], x["tx"], x["rx"]
        done = p["prefill_done"]
        if done - p["first_step"] < min_compute_s or not {"posted", "acked", "begin_ok"} <= t.keys():
            continue
        rows.append({"kv_wait": p["acked"] - done, "posted": t["posted"] - done,
                     "back": t["acked"] - r["complete"], "seen": p["acked"] - t["acked"],
                     "begin_ok": t["begin_ok"] - t["begin_sent"]})
    return rows


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))] if v else float("nan")


def stalls(log_dir: Path) -> dict:
    ms = [float(m.group(1)) for path in log_dir.glob("*.log")
          for m in re.finditer(r"event loop was stuck (\d+) ms", path.read_text(errors="replace"))]
    where: dict[str, int] = {}
    for path in log_dir.glob("*.log"):
        for m in re.finditer(r"event loop stuck over \d+ ms at (\S+ \S+)", path.read_text(errors="replace")):
            where[m.group(1)] = where.get(m.group(1), 0) + 1
    return {"episodes": len(ms), "median_ms": pct(ms, 0.5) if ms else None, "max_ms": max(ms, default=None),
            "innermost": where}


def report(log_dir: Path, min_compute_s: float) -> dict:
    rows = stages(load(log_dir), min_compute_s)
    summary = {k: {"p50_ms": pct([r[k] for r in rows], 0.5) * 1e3,
                   "p90_ms": pct([r[k] for r in rows], 0.9) * 1e3,
                   "max_ms": max((r[k] for r in rows), default=float("nan")) * 1e3} for k in STAGES}
    return {"log_dir": str(log_dir), "requests": len(rows), "stages": summary, "loop_stalls": stalls(log_dir)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dirs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--min-compute-ms", type=float, default=80.0)
    args = ap.parse_args()
    out = [report(d, args.min_compute_ms / 1e3) for d in args.log_dirs]
    for rep in out:
        print(f"{rep['log_dir']}: {rep['requests']} requests; event loop stalls: {rep['loop_stalls']}")
        for k, s in rep["stages"].items():
            print(f"  {k:9s} p50 {s['p50_ms']:8.1f}  p90 {s['p90_ms']:8.1f}  max {s['max_ms']:8.1f} ms")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
