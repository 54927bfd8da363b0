"""KV transfer benchmark: GB/s and per-transfer latency per backend, next to raw baselines.

    python -m bench.kv_bench [--json OUT] [--quick] [--backends tcp,nixl,nixl_ucx_tcp]
                             [--concurrency 1,4,16] [--conc-tokens 2048] [--tls-concurrency 1,16]
                             [--device cpu|cuda] [--connections 8]

Concurrency rows (``concurrency`` in the JSON; ``--concurrency ""`` skips them): that many TCP transfers
of ``--conc-tokens`` tokens started at once, timed from the first start_send to the last acknowledgement
(aggregate GB/s), beside a raw-socket baseline moving the same bytes over the same number of connections
(what the transfers use: all --connections when striped, else one per transfer in flight; the raw socket
splits a message over connections as striping does), the same run, rounds interleaved, each row
with the cores every thread group of either process kept busy (``cpu_cores``: where the time goes;
``raw_cpu_cores`` for the socket). ``--raw-distinct`` adds a second raw socket whose messages each come
from and land in memory of their own (``distinct_baseline_gbps``), as transfers of different requests
do, where the first resends one buffer into one buffer, which can stay in the CPU's caches.
``--variant NAME=key=value,...`` adds rows of a plaintext transport
with those TransportConfig overrides (configurations side by side in one run; the key switch_interval
sets both processes' sys.setswitchinterval for that variant's rounds instead; ``tls=true`` makes it a
TLS row, e.g. ``--variant tls_inproc=tls=true,tls_procs=0``: TLS on the connections' threads instead of
relay helpers; the helpers' CPU counts in ``cpu_cores`` as ``tls-relays``; a key ``rx.KEY`` / ``tx.KEY``
applies to the receiver / sender only). With
``--tls-concurrency`` the same transfers also run over mutual TLS (throwaway certificates,
bench/kv_certs.py): ``tcp_tls`` rows, whose ``plain_gbps`` / ``tls_ratio`` compare with the plaintext
transport of the same rounds. ``--device cuda``: the receiver's KV on GPU 1 and the sender's on GPU 0
(``--rx-gpu`` / ``--tx-gpu``, CUDA_VISIBLE_DEVICES per process), GPU->GPU over TCP through page-locked
host buffers; the raw socket moves host memory.

Layout: Llama-3.1-8B-shaped (32 layers, 8 KV heads, head_dim 128, bf16, block 16): one 16-token
block is 2 MiB over all layers, a 4096-token prompt 512 MiB. For every backend a receiver and a sender
run in two separate processes (children, so each gets its own UCX environment); each row times
start_send() -> receiver acknowledged complete, from the sender's side, for the first N blocks.

Baselines, measured in the same run and process pair: a plain blocking-socket blast (8-byte length +
sendall straight from the KV tensor, recv_into one buffer, 1-byte ack) for TCP-carried backends, and a
same-host memcpy (torch copy_) for every row. ``baseline_gbps`` is the socket blast for tcp and
nixl_ucx_tcp, memcpy for nixl with UCX's default (shared-memory capable) transports. Timings are
reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from bench.kv_peers import PeerClient, PeerError
from engine.kv_layout import KVLayout

LLAMA8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
                   model_fingerprint="bench-llama-3.1-8b")
BACKENDS = {
    "tcp": ("tcp", {}),
    "nixl": ("nixl", {}),
    "nixl_ucx_tcp": ("nixl", {"UCX_TLS": "tcp"}),
}


def _iters(nbytes: int, quick: bool) -> int:
    budget = (128 if quick else 1024) << 20  # bytes moved per row and method, roughly
    return max(2, min(20 if quick else 30, budget // nbytes))


_MEMCPY: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def memcpy_seconds(nbytes: int, iters: int) -> list[float]:
    if nbytes not in _MEMCPY:
        _MEMCPY.clear()
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in first
        _MEMCPY[nbytes] = (src, dst)
    src, dst = _MEMCPY[nbytes]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


async def bench_backend(name: str, tokens: list[int], quick: bool) -> list[dict]:
    kind, env = BACKENDS[name]
    max_blocks = max(tokens) // LLAMA8B.block_size
    layout = LLAMA8B.to_dict()
    env = {"UCX_TLS": None, **env}
    rx = await PeerClient.spawn(env=env)
    tx = await PeerClient.spawn(env=env)
    rows = []
    try:
        r = await rx.call("init", kind=kind, layout=layout, num_blocks=max_blocks)
        t = await tx.call("init", kind=kind, layout=layout, num_blocks=max_blocks)
        await tx.call("fill", tid=t["tid"], seed=1)
        endpoint = r["endpoint"]
        raw = None
        if name != "nixl":
            raw = await rx.call("raw_listen", max_bytes=max_blocks * LLAMA8B.block_bytes * LLAMA8B.num_layers)
        # Warm-up: connect, handshake, first-touch of the destination pages.
        await _timed(rx, tx, r["tid"], t["tid"], endpoint, max_blocks, 1, "warm")
        for ntok in tokens:
            nblocks = ntok // LLAMA8B.block_size
            nbytes = nblocks * LLAMA8B.block_bytes * LLAMA8B.num_layers
            iters = _iters(nbytes, quick)
            secs, sock, mem, backend = [], [], [], None
            cpu = {"kv": 0.0, "raw": 0.0}
            # Interleaved (transfer, socket blast, memcpy) rounds, so that on a shared machine every
            # method sees the same background load; medians (and best cases) are reported, plus the CPU
            # seconds both processes spent per GB (a load-independent efficiency figure).
            for i in range(iters):
                c0 = await _cpu(rx, tx)
                got, backend = await _timed(rx, tx, r["tid"], t["tid"], endpoint, nblocks, 1,
                                            f"{name}-{ntok}-{i}")
                c1 = await _cpu(rx, tx)
                cpu["kv"] += c1 - c0
                secs += got
                if raw is not None:
                    sock += (await tx.call("raw_send", tid=t["tid"], host="127.0.0.1", port=raw["port"],
                                           nbytes=nbytes, iters=1, wait_s=900))["seconds"]
                    cpu["raw"] += await _cpu(rx, tx) - c1
                mem += memcpy_seconds(nbytes, 1)
            row = _row(name, backend, ntok, nbytes, iters, secs, mem, sock or None)
            gb = nbytes * iters / 1e9
            row["cpu_s_per_gb"] = round(cpu["kv"] / gb, 3)
            row["socket_cpu_s_per_gb"] = round(cpu["raw"] / gb, 3) if raw is not None else None
            rows.append(row)
            print(_fmt(rows[-1]), flush=True)
    finally:
        await tx.close()
        await rx.close()
    return rows


def fragmented(nblocks: int, run: int, seed: int) -> list[int]:
    """Block ids 0..nblocks-1 in runs of ``run`` consecutive ids, the runs shuffled (``run`` 0: in
    order): a serving cache's free list after requests came and went."""
    import random  # noqa: PLC0415

    if run <= 0:
        return list(range(nblocks))
    runs = [list(range(i, min(i + run, nblocks))) for i in range(0, nblocks, run)]
    random.Random(seed).shuffle(runs)
    return [b for r in runs for b in r]


async def expect_send_wait(rx, tx, rtid, ttid, endpoint, nblocks: int, rids: list[str], op: str,
                           fragment: int = 0) -> dict:
    """The receiver expects nblocks blocks for each request id (the first nblocks, or with ``fragment``
    the same ones in shuffled runs of that many, differently on each side), the sender runs ``op``
    (send_many: one after the other; send_concurrent: all at once) and the receiver sees each complete;
    the sender's reply."""
    src, dst = fragmented(nblocks, fragment, 1), fragmented(nblocks, fragment, 2)
    for rid in rids:
        await rx.call("expect", tid=rtid, rid=rid, dst=dst, timeout=900)
    reply = await tx.call(op, tid=ttid, rids=rids, endpoint=endpoint, src=src, dst=dst,
                          timeout=900, wait_s=1800)
    for rid in rids:
        await rx.call("wait", tid=rtid, rid=rid)
    return reply


async def _timed(rx, tx, rtid, ttid, endpoint, nblocks, iters, tag):
    rids = [f"{tag}-{i}" for i in range(iters)]
    reply = await expect_send_wait(rx, tx, rtid, ttid, endpoint, nblocks, rids, "send_many")
    return reply["seconds"], reply["backend"]


async def _cpu(rx, tx) -> float:
    a, b = await asyncio.gather(rx.call("cpu"), tx.call("cpu"))
    return a["cpu_s"] + b["cpu_s"]


def _gbps(nbytes: int, secs: list[float] | None) -> float | None:
    return round(nbytes / statistics.median(secs) / 1e9, 3) if secs else None


def _row(name, backend, ntok, nbytes, iters, secs, mem, sock) -> dict:
    gbps, mem_gbps, sock_gbps = _gbps(nbytes, secs), _gbps(nbytes, mem), _gbps(nbytes, sock)
    best = round(nbytes / min(secs) / 1e9, 3)
    base_secs = mem if name == "nixl" else sock
    best_base = round(nbytes / min(base_secs) / 1e9, 3) if base_secs else None
    baseline = mem_gbps if name == "nixl" else sock_gbps
    return {"backend": name, "transport_backend": backend, "tokens": ntok, "bytes": nbytes, "iters": iters,
            "gbps": gbps, "baseline": "memcpy" if name == "nixl" else "socket", "baseline_gbps": baseline,
            "ratio": round(gbps / baseline, 3) if baseline else None, "gbps_best": best,
            "baseline_gbps_best": best_base, "ratio_best": round(best / best_base, 3) if best_base else None,
            "latency_ms_p50": round(statistics.median(secs) * 1e3, 3),
            "latency_ms_min": round(min(secs) * 1e3, 3),
            "latency_ms_max": round(max(secs) * 1e3, 3), "memcpy_gbps": mem_gbps, "socket_gbps": sock_gbps,
            "socket_latency_ms_p50": round(statistics.median(sock) * 1e3, 3) if sock else None}


_HEAD = (f"{'backend':<13} {'tokens':>6} {'MiB':>7} {'GB/s':>7} {'base':>6} {'base GB/s':>9} {'ratio':>6} "
         f"{'best':>6} {'p50 ms':>9} {'min ms':>9} {'memcpy':>7} {'socket':>7} {'cpu/GB':>7} "
         f"{'sock cpu/GB':>11}")


def _fmt(r: dict) -> str:
    def f(v, spec):
        return format(v, spec) if v is not None else format("-", spec.split(".")[0])
    return (f"{r['backend']:<13} {r['tokens']:>6} {r['bytes'] / 2**20:>7.1f} {f(r['gbps'], '>7.3f')} "
            f"{r['baseline']:>6} {f(r['baseline_gbps'], '>9.3f')} {f(r['ratio'], '>6.2f')} "
            f"{f(r['ratio_best'], '>6.2f')} "
            f"{r['latency_ms_p50']:>9.3f} {r['latency_ms_min']:>9.3f} {f(r['memcpy_gbps'], '>7.2f')} "
            f"{f(r['socket_gbps'], '>7.3f')} {f(r.get('cpu_s_per_gb'), '>7.3f')} "
            f"{f(r.get('socket_cpu_s_per_gb'), '>11.3f')}")


async def main_async(args) -> list[dict]:
    rows = []
    if args.backends:
        rows += await bench_sizes(args)
    if args.concurrency:
        from bench.kv_concurrency import HEAD_CONC, bench_concurrency  # noqa: PLC0415 (imports this module)

        print(f"\nconcurrent TCP transfers ({args.device}), aggregate GB/s beside a raw socket over the same "
              "number of connections", flush=True)
        print(HEAD_CONC, flush=True)
        rows += await bench_concurrency(args)
    return rows


async def bench_sizes(args) -> list[dict]:
    tokens = [16, 256, 1024] if args.quick else [16, 64, 256, 1024, 4096]
    print(f"layout: {LLAMA8B.describe()}  ({LLAMA8B.block_bytes * LLAMA8B.num_layers / 2**20:.0f} MiB per "
          f"16-token block over all layers)")
    print(_HEAD, flush=True)
    rows = []
    for name in args.backends.split(","):
        if name not in BACKENDS:
            raise SystemExit(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
        try:
            rows += await bench_backend(name, tokens, args.quick)
        except PeerError as exc:
            print(f"{name:<13} FAILED: {exc}", flush=True)
            rows.append({"backend": name, "error": str(exc), "bytes": 0, "gbps": None, "baseline_gbps": None})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write rows as a JSON list here")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="comma-separated subset of " + ",".join(BACKENDS) + " ('' skips the size rows)")
    ap.add_argument("--concurrency", default="1,4,16", help="TCP transfers in flight per row ('' = none)")
    ap.add_argument("--conc-tokens", type=int, default=0,
                    help="tokens per concurrent transfer (default 2048, --quick 512)")
    ap.add_argument("--tls-concurrency", default="1,16", help="concurrency levels also run over mutual TLS")
    ap.add_argument("--connections", type=int, default=8, help="TransportConfig.tcp_connections")
    ap.add_argument("--raw-distinct", action="store_true",
                    help="concurrency rows: also a raw socket whose messages come from and go to different "
                         "buffers, one per message (distinct_baseline_gbps / distinct_ratio), beside the one "
                         "that resends one buffer into one buffer")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                    help="concurrency rows: also a plaintext transport with these TransportConfig overrides "
                         "(e.g. spin=staging_blocking_sync=false), same rounds; repeatable")
    ap.add_argument("--fragment", type=int, default=0, metavar="RUN",
                    help="concurrency rows: each side's blocks in shuffled runs of RUN consecutive ids (a "
                         "serving cache's fragmented free list; 0: contiguous)")
    ap.add_argument("--tx-gpu", type=int, default=0, help="--device cuda: the sender's GPU (default 0)")
    ap.add_argument("--rx-gpu", type=int, default=1,
                    help="--device cuda: the receiver's GPU (default 1; 0 on a one-GPU machine: both "
                         "processes on one GPU, the TCP path still staged through host memory)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="concurrency rows: KV on GPUs 0 (sender) and 1 (receiver)")
    ap.add_argument("--certs-dir", default="/tmp/pdserve-kv-bench-certs", help="throwaway TLS certificates")
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
