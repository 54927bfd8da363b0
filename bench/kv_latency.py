"""Per-transfer latency over the real path: two OS processes, sequential one-shot sends, p50/min.

    python -m bench.kv_latency [--json OUT] [--iters 20] [--backends tcp,nixl,nixl_ucx_tcp]
        [--variant NAME=ROOT[:CONFIG_JSON] ...]

Where ``python -m bench.kv_bench`` measures bandwidth on the Llama-3.1-8B layout, this measures what
a request's TTFT pays: the time from start_send() to the receiver's acknowledgement, for a few blocks
and for many, on the tiny test model's layout (4 layers, 4 KiB per (layer, block)) and on the 8B layout
(32 layers, 64 KiB per (layer, block)). The destination ids are scattered (every other block), as a
real decode worker's free list would hand them out, so no two blocks coalesce.

Variants run side by side: each gets its own receiver/sender process pair (``ROOT``: the source tree
the children import kvtransfer from, e.g. a copy of an older commit; ``CONFIG_JSON``: TransportConfig
overrides), and requests alternate between the pairs, so every variant sees the same background load
(this box is shared). Each row reports how many NIXL WRITEs the sender posted per request and the
descriptors they carried (the transport's cumulative counters, differenced), and whether the
destination blocks equal the source blocks byte for byte. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from bench.kv_peers import PeerClient
from engine.kv_layout import KVLayout

TINY = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32",
                model_fingerprint="latency-tiny")
LLAMA8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
                   model_fingerprint="latency-llama-3.1-8b")
BACKENDS = {"tcp": ("tcp", {}), "nixl": ("nixl", {}), "nixl_ucx_tcp": ("nixl", {"UCX_TLS": "tcp"})}
# (layout name, layout, block counts); the receiver holds 2 x the largest count + 8 blocks.
CASES = [("tiny", TINY, [1, 8, 64]), ("llama8b", LLAMA8B, [1, 16, 64])]


class Pair:
    def __init__(self, name: str, root: str | None, config: dict) -> None:
        self.name, self.root, self.config = name, root, config

    async def start(self, kind: str, env: dict, layout: KVLayout, counts: list[int]) -> None:
        self.rx = await PeerClient.spawn(env=env, root=self.root)
        self.tx = await PeerClient.spawn(env=env, root=self.root)
        r = await self.rx.call("init", kind=kind, layout=layout.to_dict(), num_blocks=2 * max(counts) + 8,
                               config=self.config)
        t = await self.tx.call("init", kind=kind, layout=layout.to_dict(), num_blocks=max(counts),
                               config=self.config)
        self.rtid, self.ttid, self.ep = r["tid"], t["tid"], r["endpoint"]
        await self.tx.call("fill", tid=self.ttid, seed=7)

    async def one(self, rid: str, src: list[int], dst: list[int]) -> tuple[float, str]:
        await self.rx.call("expect", tid=self.rtid, rid=rid, dst=dst, timeout=60)
        waiting = asyncio.ensure_future(self.rx.call("wait", tid=self.rtid, rid=rid))
        got = await self.tx.call("send_many", tid=self.ttid, rids=[rid], endpoint=self.ep, src=src, dst=dst,
                                 timeout=60)
        await waiting
        return got["seconds"][0], got["backend"]

    async def counters(self) -> dict:
        return (await self.tx.call("counters", tid=self.ttid))["counters"]

    async def exact(self, src: list[int], dst: list[int]) -> bool:
        have = await self.rx.call("digest", tid=self.rtid, blocks=dst)
        want = await self.tx.call("digest", tid=self.ttid, blocks=src)
        return have["digest"] == want["digest"]

    async def close(self) -> None:
        await self.tx.close()
        await self.rx.close()


async def run_backend(name: str, iters: int, variants: list[tuple[str, str | None, dict]]) -> list[dict]:
    kind, env = BACKENDS[name]
    env = {"UCX_TLS": None, **env}
    rows = []
    for lname, layout, counts in CASES:
        pairs = [Pair(*v) for v in variants]
        try:
            for p in pairs:
                await p.start(kind, env, layout, counts)
            for n in counts:
                src, dst = list(range(n)), list(range(0, 2 * n, 2))
                secs: dict[str, list[float]] = {p.name: [] for p in pairs}
                c0 = {p.name: await p.counters() for p in pairs}
                backend = {}
                for i in range(iters + 3):  # 3 warm-ups (connect, handshake, first touch)
                    for p in pairs:  # alternating: every variant sees the same background load
                        s, backend[p.name] = await p.one(f"{lname}-{n}-{i}", src, dst)
                        if i >= 3:
                            secs[p.name].append(s)
                for p in pairs:
                    c1, reqs = await p.counters(), iters + 3
                    rows.append({
                        "backend": name, "variant": p.name, "layout": lname, "blocks": n,
                        "bytes": n * layout.num_layers * layout.block_bytes,
                        "latency_ms_p50": round(statistics.median(secs[p.name]) * 1e3, 3),
                        "latency_ms_min": round(min(secs[p.name]) * 1e3, 3),
                        "posted_xfers_per_request":
                            round((c1["nixl_posted_xfers"] - c0[p.name]["nixl_posted_xfers"]) / reqs, 3),
                        "descs_per_request": round((c1["nixl_descs"] - c0[p.name]["nixl_descs"]) / reqs, 1),
                        "byte_exact": await p.exact(src, dst), "transport_backend": backend[p.name],
                        "iters": iters, "config": p.config})
                    print(_fmt(rows[-1]), flush=True)
        finally:
            for p in pairs:
                if hasattr(p, "tx"):
                    await p.close()
    return rows


def _fmt(r: dict) -> str:
    return (f"{r['backend']:<13} {r['variant']:<14} {r['layout']:<8} {r['blocks']:>4} "
            f"{r['bytes'] / 2**20:>8.2f} MiB  p50 {r['latency_ms_p50']:>8.3f} ms  "
            f"min {r['latency_ms_min']:>8.3f} ms"
            f"  xfers/req {r['posted_xfers_per_request']:>5}  descs/req {r['descs_per_request']:>7}"
            f"  exact {r['byte_exact']}")


def parse_variant(text: str) -> tuple[str, str | None, dict]:
    name, _, rest = text.partition("=")
    root, _, config = rest.partition(":")
    return name, root or None, json.loads(config) if config else {}


async def main_async(args) -> list[dict]:
    variants = [parse_variant(v) for v in args.variant] or [("current", None, {})]
    rows = []
    for name in args.backends.split(","):
        rows += await run_backend(name, args.iters, variants)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write rows as a JSON list here")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=ROOT[:CONFIG_JSON]; ROOT empty = this tree (repeatable, run side by side)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = asyncio.run(main_async(args))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        command = "python -m bench.kv_latency " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
