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
relay helpers; the helpers' CPU counts in ``cpu_cores`` as ``tls-relays``). With
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
import contextlib
import dataclasses
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


async def _timed(rx, tx, rtid, ttid, endpoint, nblocks, iters, tag):
    rids = [f"{tag}-{i}" for i in range(iters)]
    blocks = list(range(nblocks))
    for rid in rids:
        await rx.call("expect", tid=rtid, rid=rid, dst=blocks, timeout=900)
    reply = await tx.call("send_many", tid=ttid, rids=rids, endpoint=endpoint, src=blocks, dst=blocks,
                          timeout=900, wait_s=1800)
    for rid in rids:
        await rx.call("wait", tid=rtid, rid=rid)
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


async def bench_concurrency(args) -> list[dict]:
    from bench.kv_certs import tls_config, write_certs  # noqa: PLC0415

    levels = [int(c) for c in args.concurrency.split(",") if c]
    tls_levels = [int(c) for c in args.tls_concurrency.split(",") if c]
    ntok = args.conc_tokens or (512 if args.quick else 2048)
    nblocks = ntok // LLAMA8B.block_size
    nbytes = nblocks * LLAMA8B.block_bytes * LLAMA8B.num_layers
    reps = 2 if args.quick else 3
    cuda = args.device == "cuda"
    env_rx = {"UCX_TLS": None, **({"CUDA_VISIBLE_DEVICES": str(args.rx_gpu)} if cuda else {})}
    env_tx = {"UCX_TLS": None, **({"CUDA_VISIBLE_DEVICES": str(args.tx_gpu)} if cuda else {})}
    device = "cuda" if cuda else "cpu"
    rx, tx = await PeerClient.spawn(env=env_rx), await PeerClient.spawn(env=env_tx)
    cfg = {"tcp_connections": args.connections, "send_timeout_s": 900, "stall_timeout_s": 120}
    layout = dataclasses.replace(LLAMA8B, memory=device).to_dict()
    rows = []
    try:
        sides = {}
        variants = dict(_parse_variant(v) for v in args.variant)
        tls_rows = {"tcp_tls"} | {name for name, v in variants.items() if v.get("tls")}
        certs = write_certs(Path(args.certs_dir), ["prefill", "decode"]) if tls_levels else None
        for name in ["tcp"] + (["tcp_tls"] if tls_levels else []) + list(variants):
            if name in tls_rows and not tls_levels:
                continue
            extra_rx = extra_tx = {k: v for k, v in variants.get(name, {}).items()
                                   if k not in ("switch_interval", "tls")}
            if name in tls_rows:
                extra_rx = {**extra_rx, **tls_config(certs, "decode")}
                extra_tx = {**extra_tx, **tls_config(certs, "prefill")}
            r = await rx.call("init", kind="tcp", layout=layout, num_blocks=nblocks, device=device,
                              config={**cfg, **extra_rx})
            t = await tx.call("init", kind="tcp", layout=layout, num_blocks=nblocks, device=device,
                              config={**cfg, **extra_tx})
            await tx.call("fill", tid=t["tid"], seed=1)
            sides[name] = (r["tid"], t["tid"], r["endpoint"])
            await _concurrent(rx, tx, sides[name], nblocks, 1, f"{name}-warm")
        raw = await rx.call("raw_listen", max_bytes=nbytes)
        cold = await rx.call("raw_listen", max_bytes=nbytes, slots=max(levels)) if args.raw_distinct else None
        plain_tid = sides["tcp"][1]
        for c in levels:
            # connections a row's transfers use: all of them when striped (a transfer of more than one
            # frame), else one per transfer in flight; the raw socket moves the same bytes over as many
            lanes = {}
            for name in sides:
                conf = {"tcp_connections": args.connections, "tcp_stripe": True,
                        **{k: v for k, v in variants.get(name, {}).items() if k != "tls"}}
                striped = conf["tcp_stripe"] and nbytes > conf.get("max_frame_bytes", 16 << 20)
                lanes[name] = conf["tcp_connections"] if striped else min(c, conf["tcp_connections"])
            got: dict = {name: [] for name in sides}
            each: dict[str, list] = {name: [] for name in sides}
            cpu: dict = {name: {} for name in sides}
            io: dict[str, dict] = {name: {} for name in sides}
            for n in set(lanes.values()):  # the raw socket over each number of connections a row uses
                got[("raw", n)], got[("cold", n)], cpu[("raw", n)] = [], [], {}
            for rep in range(reps):
                for name in sides:
                    if name in tls_rows and c not in tls_levels:
                        continue
                    async with _cpu_into(rx, tx, cpu[name], sides[name], io[name]), \
                            _switch_interval(rx, tx, variants.get(name, {}).get("switch_interval")):
                        wall, per = await _concurrent(rx, tx, sides[name], nblocks, c, f"{name}-c{c}-{rep}")
                    got[name].append(wall)
                    each[name] += per
                for n in set(lanes.values()):
                    async with _cpu_into(rx, tx, cpu[("raw", n)]):
                        got[("raw", n)].append((await tx.call(
                            "raw_send_concurrent", tid=plain_tid, host="127.0.0.1", port=raw["port"],
                            nbytes=nbytes, conns=n, messages=c, wait_s=1800))["seconds"])
                    if cold is not None:
                        got[("cold", n)].append((await tx.call(
                            "raw_send_concurrent", tid=plain_tid, host="127.0.0.1", port=cold["port"],
                            nbytes=nbytes, conns=n, messages=c, distinct=True, wait_s=1800))["seconds"])
            for name in sides:
                if not got[name]:
                    continue
                n = lanes[name]
                row = _conc_row(name, c, n, ntok, nbytes, got[name], each[name], got[("raw", n)], args.device)
                if got[("cold", n)]:
                    row["distinct_baseline_gbps"] = _gbps(nbytes * c, got[("cold", n)])
                    row["distinct_ratio"] = round(row["gbps"] / row["distinct_baseline_gbps"], 3)
                row["cpu_cores"] = _cores(cpu[name], sum(got[name]))
                row["raw_cpu_cores"] = _cores(cpu[("raw", n)], sum(got[("raw", n)]))
                row["io"] = _io_summary(io[name], sum(got[name]), n)
                if name in tls_rows:
                    row["plain_gbps"] = _gbps(nbytes * c, got["tcp"])
                    row["tls_ratio"] = round(row["gbps"] / row["plain_gbps"], 3)
                rows.append(row)
                print(_fmt_conc(row), flush=True)
                print(f"{'':<8} cores busy, {_fmt_cores(row['cpu_cores'])}; raw socket "
                      f"{_fmt_cores(row['raw_cpu_cores'])}", flush=True)
                for way, d in row["io"].items():
                    print(f"{'':<8} {way} I/O threads: {d['kib_per_syscall']} KiB/syscall, "
                          f"{d['poll_share']} of their time in poll, each connection's thread busy "
                          f"{d['thread_busy']}", flush=True)
    finally:
        await tx.close()
        await rx.close()
    return rows


def _parse_variant(text: str) -> tuple[str, dict]:
    """NAME=key=value[,key=value...] -> (NAME, TransportConfig overrides); values are JSON where they
    parse (numbers, true/false), else strings."""
    name, _, rest = text.partition("=")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    if not name or name in ("tcp", "tcp_tls", "raw") or not overrides:
        raise SystemExit(f"--variant {text!r}: want NAME=key=value[,key=value] with a new NAME")
    return name, overrides


@contextlib.asynccontextmanager
async def _cpu_into(rx, tx, acc: dict, side: tuple | None = None, io: dict | None = None):
    """Add the CPU seconds each side's thread groups spent inside the block to acc[side][group], and the
    whole process's to acc[side]["process"]; with a transport pair (side), what its TCP I/O threads did
    (counters' tcp_tx_io on the sender, tcp_rx_io on the receiver) to io["tx"] / io["rx"]."""
    async def io_now():
        if side is None:
            return None
        a, b = await asyncio.gather(rx.call("counters", tid=side[0]), tx.call("counters", tid=side[1]))
        return {"rx": a["counters"]["tcp_rx_io"], "tx": b["counters"]["tcp_tx_io"]}

    before, io0 = await asyncio.gather(rx.call("cpu"), tx.call("cpu")), await io_now()
    yield
    after, io1 = await asyncio.gather(rx.call("cpu"), tx.call("cpu")), await io_now()
    for name, a, b in zip(("rx", "tx"), before, after, strict=True):
        into = acc.setdefault(name, {})
        into["process"] = into.get("process", 0.0) + b["cpu_s"] - a["cpu_s"]  # threads that exited too
        for group, secs in b["threads"].items():
            into[group] = into.get(group, 0.0) + secs - a["threads"].get(group, 0.0)
    if io is not None and io0 is not None:
        for name in ("rx", "tx"):
            into = io.setdefault(name, {})
            for key, value in io1[name].items():
                into[key] = into.get(key, 0) + value - io0[name][key]


@contextlib.asynccontextmanager
async def _switch_interval(rx, tx, seconds: float | None):
    """Both peers run the block with this GIL switch interval (sys.setswitchinterval), then the old one."""
    if seconds is None:
        yield
        return
    old = await asyncio.gather(rx.call("switch_interval", seconds=seconds),
                               tx.call("switch_interval", seconds=seconds))
    try:
        yield
    finally:
        await asyncio.gather(rx.call("switch_interval", seconds=old[0]["old"]),
                             tx.call("switch_interval", seconds=old[1]["old"]))


def _io_summary(io: dict, wall_s: float, conns: int) -> dict:
    """Per direction: KiB moved per syscall, the share of the I/O threads' time spent waiting in poll,
    and how busy each connection's thread was (thread time over wall time x connections)."""
    out = {}
    for name, d in io.items():
        if not d.get("frames"):
            continue
        out[name] = {"kib_per_syscall": round(d["bytes"] / max(1, d["syscalls"]) / 1024, 1),
                     "poll_share": round(d["poll_s"] / d["thread_s"], 3) if d["thread_s"] else None,
                     "thread_busy": round(d["thread_s"] / (wall_s * conns), 3), **d}
    return out


def _cores(acc: dict, wall_s: float) -> dict:
    """CPU seconds per thread group over wall seconds: the cores each kept busy on average."""
    return {side: {g: round(s / wall_s, 2) for g, s in sorted(groups.items(), key=lambda kv: -kv[1])
                   if s / wall_s >= 0.01} for side, groups in acc.items()}


def _fmt_cores(cores: dict) -> str:
    return "; ".join(f"{side}: " + " ".join(f"{g} {v:.2f}" for g, v in groups.items())
                     for side, groups in cores.items())


async def _concurrent(rx, tx, side, nblocks, c, tag) -> tuple[float, list[float]]:
    """c transfers of nblocks started at once; (wall seconds, each one's seconds)."""
    rtid, ttid, endpoint = side
    rids = [f"{tag}-{i}" for i in range(c)]
    blocks = list(range(nblocks))
    for rid in rids:
        await rx.call("expect", tid=rtid, rid=rid, dst=blocks, timeout=900)
    reply = await tx.call("send_concurrent", tid=ttid, rids=rids, endpoint=endpoint, src=blocks, dst=blocks,
                          timeout=900, wait_s=1800)
    for rid in rids:
        await rx.call("wait", tid=rtid, rid=rid)
    return reply["seconds"], reply["each"]


def _conc_row(name, c, conns, ntok, nbytes, secs, each, raw, device) -> dict:
    gbps, raw_gbps = _gbps(nbytes * c, secs), _gbps(nbytes * c, raw)
    return {"backend": name, "concurrency": c, "connections": conns, "device": device, "tokens": ntok,
            "bytes": nbytes, "rounds": len(secs), "gbps": gbps,
            "gbps_best": round(nbytes * c / min(secs) / 1e9, 3),
            "baseline": "socket", "baseline_gbps": raw_gbps, "ratio": round(gbps / raw_gbps, 3),
            "transfer_ms_p50": round(statistics.median(each) * 1e3, 2),
            "transfer_ms_max": round(max(each) * 1e3, 2)}


_HEAD_CONC = (f"{'backend':<8} {'conc':>4} {'conns':>5} {'tokens':>6} {'MiB each':>8} {'GB/s':>7} "
              f"{'socket GB/s':>11} {'ratio':>6} {'p50 ms':>9} {'max ms':>9} {'vs plain':>8} "
              f"{'distinct GB/s':>13} {'ratio':>6}")


def _fmt_conc(r: dict) -> str:
    vs = f"{r['tls_ratio']:>8.2f}" if "tls_ratio" in r else f"{'-':>8}"
    return (f"{r['backend']:<8} {r['concurrency']:>4} {r['connections']:>5} {r['tokens']:>6} "
            f"{r['bytes'] / 2**20:>8.1f} {r['gbps']:>7.3f} {r['baseline_gbps']:>11.3f} {r['ratio']:>6.2f} "
            f"{r['transfer_ms_p50']:>9.1f} {r['transfer_ms_max']:>9.1f} {vs} "
            f"{r.get('distinct_baseline_gbps') or 0:>13.3f} {r.get('distinct_ratio') or 0:>6.2f}")


async def main_async(args) -> list[dict]:
    rows = []
    if args.backends:
        rows += await bench_sizes(args)
    if args.concurrency:
        print(f"\nconcurrent TCP transfers ({args.device}), aggregate GB/s beside a raw socket over the same "
              "number of connections", flush=True)
        print(_HEAD_CONC, flush=True)
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
