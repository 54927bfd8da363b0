"""TCP KV transfers between two transports of one process on one GPU, in TransportConfig variants
side by side (by default staged on the connections' threads, ``tcp_lane_staging``, against staged on the
event loop), rounds alternated, with where each frame's time went (``where_ms``, from the trace).

What it is for: where only one GPU is lent, ``bench.kv_bench --device cuda`` puts its two processes on
that GPU, and two CUDA contexts on one device time-slice: every row collapses, whichever way it stages
(2.6-3.7 GB/s at 4 and 16 in flight on an H200 where two GPUs move 9-13). One process has one context,
and all its threads (both transports' lanes and the event loop) share one GIL, the contention the
lane staging is meant to relieve, at its worst. So this compares the two stagings with each other, not
with a raw socket; the cross-GPU ratios come from kv_bench on two GPUs.

    python -m bench.lane_staging_probe --out DIR [--concurrency 1,4,16] [--tokens 2048] [--rounds 3]
                                       [--variant NAME=key=value,...]...
    (bash bench/device_run.sh lane-staging)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from bench.kv_bench import LLAMA8B
from bench.kv_concurrency import _parse_variant
from bench.kv_peer_proc import fill_random
from kvtransfer import make_transport
from kvtransfer.trace import frame_summary

DEFAULT_VARIANTS = ["loop=tcp_lane_staging=false", "lanes=tcp_lane_staging=true"]


def _where(sends: list, exps: list) -> dict:
    """Per DATA frame, mean seconds of the sender's steps (queued before staging, staging copies, waiting
    for a lane, in the lane: queue + socket) and of the receiver's (dispatch to done, in the read thread,
    the connection's gap before it); per transfer, the receiver's wait for its last host->device copies
    (END to complete) and the sender's for the acknowledgement (last frame written to DONE)."""
    frames = [f for s in sends for f in s.frame_times]
    n = max(1, len(frames))
    out = {"tx_" + k: round(v / n * 1e3, 3) for k, v in frame_summary(frames).items()
           if k.endswith("_s") and k != "span_s"} if frames else {}
    rx = {}
    for e in exps:
        for k, v in e.frame_stats.items():
            rx[k] = rx.get(k, 0) + v
    m = max(1, rx.get("frames", 0))
    out.update({"rx_" + k: round(rx.get(k, 0.0) / m * 1e3, 3) for k in ("frame_s", "thread_s", "gap_s")})
    ends = [e.timeline["complete"] - e.timeline["end"] for e in exps if "end" in e.timeline]
    acks = [s.timeline["acked"] - s.timeline["sent"] for s in sends if "sent" in s.timeline]
    out["rx_end_to_complete_ms"] = round(statistics.mean(ends) * 1e3, 3) if ends else None
    out["tx_sent_to_acked_ms"] = round(statistics.mean(acks) * 1e3, 3) if acks else None
    return out


async def _round(pairs: dict, mode: str, conc: int, nblocks: int) -> tuple[float, float, dict]:
    """One round: ``conc`` transfers started at once; (aggregate GB/s, p50 transfer seconds, _where)."""
    a, b = pairs[mode]
    rids = [f"{mode}-{conc}-{time.monotonic_ns()}-{i}" for i in range(conc)]
    t0 = time.monotonic()
    ids = [list(range(i * nblocks, (i + 1) * nblocks)) for i in range(conc)]  # the same blocks both sides
    exps = [b.expect(rid, ids[i], timeout=300) for i, rid in enumerate(rids)]
    sends = [a.start_send(rid, b.endpoint(), ids[i], ids[i], timeout=300) for i, rid in enumerate(rids)]
    done = await asyncio.gather(*(s.wait() for s in sends), *(e.wait() for e in exps))
    wall = time.monotonic() - t0
    nbytes = sum(d["bytes"] for d in done[:conc])
    return nbytes / wall / 1e9, statistics.median(d["seconds"] for d in done[:conc]), _where(sends, exps)


async def main(args) -> list[dict]:
    levels = [int(c) for c in args.concurrency.split(",")]
    nblocks = args.tokens // LLAMA8B.block_size
    layout = dataclasses.replace(LLAMA8B, memory=args.device)
    src = layout.allocate(nblocks * max(levels))
    dst = layout.allocate(nblocks * max(levels))
    fill_random(src, 1)
    pairs = {}
    modes = dict(_parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS))
    for mode, overrides in modes.items():
        cfg = {"tcp_connections": args.connections, "stall_timeout_s": 120,
               "trace": True,  # per-frame times (_where); only log lines otherwise
               "force_staging": True,  # (a CUDA cache is staged anyway; a host one for a CPU check)
               **overrides}
        pairs[mode] = (await make_transport("tcp", layout, src, **cfg).start(),
                       await make_transport("tcp", layout, dst, **cfg).start())
        await _round(pairs, mode, 1, nblocks)  # warm: connections, staging buffers
    rows = []
    for conc in levels:
        got: dict = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:  # alternated, so drift hits all
                got[mode].append(await _round(pairs, mode, conc, nblocks))
        for mode in modes:
            gbps = [g for g, _s, _w in got[mode]]
            where = {k: round(statistics.median(w[k] for *_x, w in got[mode] if w.get(k) is not None), 3)
                     for k in got[mode][0][2] if any(w.get(k) is not None for *_x, w in got[mode])}
            rows.append({"mode": mode, "config": modes[mode], "concurrency": conc, "tokens": args.tokens,
                         "mib_each": nblocks * layout.block_bytes * layout.num_layers / 2**20,
                         "connections": args.connections, "rounds": args.rounds,
                         "gbps": round(statistics.median(gbps), 3), "gbps_best": round(max(gbps), 3),
                         "transfer_ms_p50": round(statistics.median(s for _g, s, _w in got[mode]) * 1e3, 1),
                         "where_ms": where})
        level = [r for r in rows if r["concurrency"] == conc]
        for r in level:
            r["vs_first"] = round(r["gbps"] / level[0]["gbps"], 3)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8)), "bytes differ after the rounds"
    for a, b in pairs.values():
        await a.close()
        await b.close()
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                    help="TransportConfig overrides per compared mode, the first the reference "
                         f"(default: {' '.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: host caches with force_staging (a check of the probe, not a measurement)")
    args = ap.parse_args()
    rows = asyncio.run(main(args))
    print(f"{'mode':10} {'conc':>4} {'GB/s':>8} {'best':>8} {'p50 ms':>8} {'vs first':>8}")
    for r in rows:
        print(f"{r['mode']:10} {r['concurrency']:>4} {r['gbps']:>8.2f} {r['gbps_best']:>8.2f} "
              f"{r['transfer_ms_p50']:>8.1f} {r['vs_first']:>8}")
        print("       ms: " + " ".join(f"{k} {v}" for k, v in r["where_ms"].items()))
    out = Path(args.out) / "lane-staging-probe.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                               "command": "python -m bench.lane_staging_probe " + " ".join(
                                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
