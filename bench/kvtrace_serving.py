"""Where a served request's KV time goes: the ``kvtrace`` lines of a cluster's worker logs, per rate.

    PDSERVE_KV_TRACE=1 bash bench/device_run.sh frontier -- --modes 1p1d-tcp,1p1d-nixl --rates 6,10,14 ...
    python3 bench/kvtrace_serving.py OUT/frontier-logs [--json FILE]

For every mode directory (``<mode>/logs/*.log``) the prefill worker's ``kvtrace prefill`` lines and both
sides' transfer lines (kvtransfer/trace.py) are joined by request id (``kvtrace_report.load``; that
report takes the NIXL path's stages after the prefill, this one the TCP path's frames and the rate
points). Requests are grouped into the sweep's rate points by their arrival (a pause of more than
``--gap-s`` between two arrivals starts the next point). Per point, p50 / p90 in milliseconds of:

* ``queue``: prefill RPC called -> the engine's first step of it;
* ``compute``: first step -> prefill done (its last layer computed and sampled);
* ``after``: prefill done -> the transfer acknowledged (what the KV plane adds to TTFT);
* TCP only, per DATA frame: ``staging`` (device->host copy), ``lane_wait`` and ``in_lane`` on the
  sender; ``rx_thread`` (its read) and ``rx_gap`` (the connection idle before it) on the receiver.

and the check behind the router's drain wait (router/shedding.py), where the sender's frame counts are
there: ``answer`` (prefill RPC called -> acknowledged, the time the router waits for it) beside
``ahead_over_rate`` (the frames of the requests called before it and not yet acknowledged, over the
point's mean frames per second: Little's law), and ``overtaken``, how many pairs of the point were
acknowledged in the other order than they were computed (0: the KV plane serves transfers in order).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtrace_report import load, pct  # bench/ is on the path when this runs as a script


def requests(logs: Path) -> list[dict]:
    """The requests that have the prefill worker's line, by arrival (kvtrace_report.load joins the lines)."""
    return sorted((v for v in load(logs).values() if "prefill" in v), key=lambda v: v["prefill"]["called"])


def points(requests: list[dict], gap_s: float) -> list[list[dict]]:
    out: list[list[dict]] = []
    last = None
    for r in requests:
        called = r["prefill"]["called"]
        if last is None or called - last > gap_s:
            out.append([])
        out[-1].append(r)
        last = called
    return out


def _per_frame(stats: dict, key: str) -> float | None:
    frames = stats.get("frames")
    return stats[key] / frames if frames and key in stats else None


def measures(r: dict) -> dict[str, float | None]:
    p, tx, rx = r["prefill"], r.get("tx-frames", {}), r.get("rx-frames", {})
    return {"queue": p["first_step"] - p["called"], "compute": p["prefill_done"] - p["first_step"],
            "after": p["acked"] - p["prefill_done"] if "acked" in p else None,
            "staging": _per_frame(tx, "staging_s"), "lane_wait": _per_frame(tx, "lane_wait_s"),
            "in_lane": _per_frame(tx, "in_lane_s"), "rx_thread": _per_frame(rx, "thread_s"),
            "rx_gap": _per_frame(rx, "gap_s")}


def littles_law(requests: list[dict]) -> dict[str, list[float]]:
    """Per request with a frame count: its time to the answer, and the frames ahead of it over the
    point's throughput; and how many pairs were acknowledged out of their compute order."""
    rows = [(r["prefill"], r["tx-frames"]["frames"]) for r in requests
            if "acked" in r["prefill"] and r.get("tx-frames", {}).get("frames")]
    if len(rows) < 2:
        return {}
    span = max(p["acked"] for p, _ in rows) - min(p["called"] for p, _ in rows)
    rate = sum(f for _, f in rows) / span if span > 0 else 0.0
    if rate <= 0:
        return {}
    answer, ahead = [], []
    for p, _ in rows:
        answer.append(p["acked"] - p["called"])
        ahead.append(sum(f for q, f in rows if q["called"] < p["called"] < q["acked"]) / rate)
    overtaken = sum(1 for a, _ in rows for b, _ in rows
                    if a["prefill_done"] < b["prefill_done"] and b["acked"] < a["acked"])
    return {"answer": answer, "ahead_over_rate": ahead, "overtaken": [float(overtaken)]}


def summarise(requests: list[dict]) -> dict:
    rows = [measures(r) for r in requests]
    out: dict = {"requests": len(rows)}
    for key in rows[0] if rows else ():
        xs = [row[key] for row in rows if row[key] is not None]
        if xs:
            out[key] = {"p50_ms": round(pct(xs, 0.5) * 1e3, 1), "p90_ms": round(pct(xs, 0.9) * 1e3, 1)}
    law = littles_law(requests)
    for key in ("answer", "ahead_over_rate"):
        if key in law:
            xs = law[key]
            out[key] = {"p50_ms": round(pct(xs, 0.5) * 1e3, 1), "p90_ms": round(pct(xs, 0.9) * 1e3, 1)}
    if "overtaken" in law:
        out["overtaken"] = int(law["overtaken"][0])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logdir", help="a frontier run's frontier-logs directory (one sub-directory per mode)")
    ap.add_argument("--gap-s", type=float, default=1.5, help="a pause in arrivals that starts a rate point")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    result: dict = {}
    for mode_dir in sorted(p for p in Path(args.logdir).iterdir() if (p / "logs").is_dir()):
        groups = points(requests(mode_dir / "logs"), args.gap_s)
        result[mode_dir.name] = [summarise(group) for group in groups]
        for i, s in enumerate(result[mode_dir.name]):
            cells = "  ".join(f"{k} {v['p50_ms']}/{v['p90_ms']}" for k, v in s.items() if isinstance(v, dict))
            more = f"  overtaken {s['overtaken']}" if "overtaken" in s else ""
            print(f"{mode_dir.name:<12} point {i + 1} ({s['requests']} requests)  p50/p90 ms: {cells}{more}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
