"""Per-transfer latency over the real path: two OS processes, sequential one-shot sends, p50/min.

    python -m kvtransfer.latency [--json OUT] [--iters 40] [--backends tcp,nixl,nixl_ucx_tcp]

Where ``python -m kvtransfer.bench`` measures bandwidth on the Llama-3.1-8B layout, this measures what
a request's TTFT pays: the time from start_send() to the receiver's acknowledgement, for a few blocks
and for many, on the tiny test model's layout (4 layers, 4 KiB per (layer, block)) and on the 8B layout
(32 layers, 64 KiB per (layer, block)). The destination ids are scattered (every other block), as a
real decode worker's free list would hand them out, so NIXL gets one descriptor per (layer, block).
Each row also reports how many NIXL transfers the sender posted per request and how many
descriptors they carried (the transport's cumulative counters, differenced). Timings are reported,
never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from engine.kv_layout import KVLayout

from .client import PeerClient

TINY = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32",
                model_fingerprint="latency-tiny")
LLAMA8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
                   model_fingerprint="latency-llama-3.1-8b")
BACKENDS = {"tcp": ("tcp", {}), "nixl": ("nixl", {}), "nixl_ucx_tcp": ("nixl", {"UCX_TLS": "tcp"})}
# (layout name, layout, [block counts], receiver blocks)
CASES = [("tiny", TINY, [1, 8, 64], 160), ("llama8b", LLAMA8B, [1, 16, 128], 272)]


async def run_backend(name: str, iters: int, config: dict) -> list[dict]:
    kind, env = BACKENDS[name]
    rows = []
    for lname, layout, counts, nblocks in CASES:
        rx = await PeerClient.spawn(env={"UCX_TLS": None, **env})
        tx = await PeerClient.spawn(env={"UCX_TLS": None, **env})
        try:
            r = await rx.call("init", kind=kind, layout=layout.to_dict(), num_blocks=nblocks, config=config)
            t = await tx.call("init", kind=kind, layout=layout.to_dict(), num_blocks=nblocks, config=config)
            await tx.call("fill", tid=t["tid"], seed=7)
            ep = r["endpoint"]
            for n in counts:
                src = list(range(n))
                dst = list(range(0, 2 * n, 2))  # scattered: no two destination blocks adjacent
                secs, wall = [], []
                c0 = (await tx.call("counters", tid=t["tid"]))["counters"]
                for i in range(iters + 3):  # 3 warm-ups (connect, handshake, first touch)
                    rid = f"{lname}-{n}-{i}"
                    await rx.call("expect", tid=r["tid"], rid=rid, dst=dst, timeout=60)
                    w0 = time.perf_counter()
                    fut = asyncio.ensure_future(rx.call("wait", tid=r["tid"], rid=rid))
                    got = await tx.call("send_many", tid=t["tid"], rids=[rid], endpoint=ep, src=src, dst=dst,
                                        timeout=60)
                    await fut
                    if i >= 3:
                        secs.append(got["seconds"][0])
                        wall.append(time.perf_counter() - w0)
                c1 = (await tx.call("counters", tid=t["tid"]))["counters"]
                have = await rx.call("digest", tid=r["tid"], blocks=dst)
                want = await tx.call("digest", tid=t["tid"], blocks=src)
                reqs = iters + 3
                rows.append({
                    "backend": name, "layout": lname, "blocks": n,
                    "bytes": n * layout.num_layers * layout.block_bytes,
                    "latency_ms_p50": round(statistics.median(secs) * 1e3, 3),
                    "latency_ms_min": round(min(secs) * 1e3, 3),
                    "wall_ms_p50": round(statistics.median(wall) * 1e3, 3),
                    "posted_xfers_per_request": round((c1["nixl_posted_xfers"] - c0["nixl_posted_xfers"])
                                                      / reqs, 3),
                    "descs_per_request": round((c1["nixl_descs"] - c0["nixl_descs"]) / reqs, 1),
                    "byte_exact": have["digest"] == want["digest"], "transport_backend": got["backend"],
                    "iters": iters, "config": config})
                print(_fmt(rows[-1]), flush=True)
        finally:
            await tx.close()
            await rx.close()
    return rows


def _fmt(r: dict) -> str:
    return (f"{r['backend']:<13} {r['layout']:<8} {r['blocks']:>5} {r['bytes'] / 2**20:>8.2f} MiB  "
            f"p50 {r['latency_ms_p50']:>8.3f} ms  min {r['latency_ms_min']:>8.3f} ms  "
            f"xfers/req {r['posted_xfers_per_request']:>5}  descs/req {r['descs_per_request']:>7}  "
            f"exact {r['byte_exact']}")


async def main_async(args) -> list[dict]:
    config = json.loads(args.config) if args.config else {}
    rows = []
    for name in args.backends.split(","):
        rows += await run_backend(name, args.iters, config)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write rows as a JSON list here")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--config", help="TransportConfig overrides as JSON, e.g. '{\"nixl_prepped\": false}'")
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
