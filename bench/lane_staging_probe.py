"""TCP KV transfers between two transports of one process on one GPU, staged on the connections'
threads (``tcp_lane_staging``) against staged on the event loop, rounds alternated.

What it is for: where only one GPU is lent, ``bench.kv_bench --device cuda`` puts its two processes on
that GPU, and two CUDA contexts on one device time-slice: every row collapses, whichever way it stages
(2.6-3.7 GB/s at 4 and 16 in flight on an H200 where two GPUs move 9-13). One process has one context,
and all its threads (both transports' lanes and the event loop) share one GIL, the contention the
lane staging is meant to relieve, at its worst. So this compares the two stagings with each other, not
with a raw socket; the cross-GPU ratios come from kv_bench on two GPUs.

    python -m bench.lane_staging_probe --out DIR [--concurrency 1,4,16] [--tokens 2048] [--rounds 3]
    (bash bench/device_run.sh lane-staging)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.kv_bench import LLAMA8B
from bench.kv_peer_proc import fill_random
from kvtransfer import make_transport

MODES = {"lanes": True, "loop": False}


async def _round(pairs: dict, mode: str, conc: int, nblocks: int) -> tuple[float, float]:
    """One round: ``conc`` transfers started at once; (aggregate GB/s, p50 transfer seconds)."""
    a, b = pairs[mode]
    rids = [f"{mode}-{conc}-{time.monotonic_ns()}-{i}" for i in range(conc)]
    t0 = time.monotonic()
    exps = [b.expect(rid, list(range(i * nblocks, (i + 1) * nblocks)), timeout=300) for i, rid in enumerate(rids)]
    sends = [a.start_send(rid, b.endpoint(), list(range(i * nblocks, (i + 1) * nblocks)),
                          list(range(i * nblocks, (i + 1) * nblocks)), timeout=300) for i, rid in enumerate(rids)]
    done = await asyncio.gather(*(s.wait() for s in sends), *(e.wait() for e in exps))
    wall = time.monotonic() - t0
    nbytes = sum(d["bytes"] for d in done[:conc])
    return nbytes / wall / 1e9, statistics.median(d["seconds"] for d in done[:conc])


async def main(args) -> list[dict]:
    levels = [int(c) for c in args.concurrency.split(",")]
    nblocks = args.tokens // LLAMA8B.block_size
    layout = dataclasses.replace(LLAMA8B, memory=args.device)
    src = layout.allocate(nblocks * max(levels))
    dst = layout.allocate(nblocks * max(levels))
    fill_random(src, 1)
    pairs = {}
    for mode, on in MODES.items():
        cfg = {"tcp_connections": args.connections, "tcp_lane_staging": on, "stall_timeout_s": 120,
               "force_staging": True}  # (a CUDA cache is staged anyway; a host one for a CPU check)
        pairs[mode] = (await make_transport("tcp", layout, src, **cfg).start(),
                       await make_transport("tcp", layout, dst, **cfg).start())
        await _round(pairs, mode, 1, nblocks)  # warm: connections, staging buffers
    rows = []
    for conc in levels:
        got: dict = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:  # alternated, so drift hits both
                got[mode].append(await _round(pairs, mode, conc, nblocks))
        for mode in MODES:
            gbps = [g for g, _ in got[mode]]
            rows.append({"mode": mode, "concurrency": conc, "tokens": args.tokens,
                         "mib_each": nblocks * layout.block_bytes * layout.num_layers / 2**20,
                         "connections": args.connections, "rounds": args.rounds,
                         "gbps": round(statistics.median(gbps), 3), "gbps_best": round(max(gbps), 3),
                         "transfer_ms_p50": round(statistics.median(s for _, s in got[mode]) * 1e3, 1)})
        lanes, loop = rows[-2]["gbps"], rows[-1]["gbps"]
        rows[-2]["vs_loop"] = round(lanes / loop, 3)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8)), "bytes differ after the rounds"
    for a, b in pairs.values():
        await a.close()
        await b.close()
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: host caches with force_staging (a check of the probe, not a measurement)")
    args = ap.parse_args()
    rows = asyncio.run(main(args))
    print(f"{'mode':6} {'conc':>4} {'GB/s':>8} {'best':>8} {'p50 ms':>8} {'vs loop':>8}")
    for r in rows:
        print(f"{r['mode']:6} {r['concurrency']:>4} {r['gbps']:>8.2f} {r['gbps_best']:>8.2f} "
              f"{r['transfer_ms_p50']:>8.1f} {r.get('vs_loop', ''):>8}")
    out = Path(args.out) / "lane-staging-probe.json"
    out.write_text(json.dumps({"commit": _commit(), "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                               "command": "python -m bench.lane_staging_probe " + " ".join(
                                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
