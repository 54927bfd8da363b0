"""The concurrency rows of ``python -m bench.kv_bench`` (``--concurrency``, ``--tls-concurrency``,
``--variant``, ``--raw-distinct``): that many TCP transfers in flight at once, beside raw sockets over
the same connections, with where the time went (each thread group's cores, the I/O threads' counters).
See bench/kv_bench.py's docstring for the rows' meaning."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
from pathlib import Path

from bench.kv_bench import LLAMA8B, _gbps, expect_send_wait
from bench.kv_peers import PeerClient


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
            both = {k: v for k, v in variants.get(name, {}).items()
                    if k not in _PROCESS_KNOBS + ("tls",) and not k.startswith(("rx.", "tx."))}
            extra_rx, extra_tx = ({**both, **_side(variants.get(name, {}), side)} for side in ("rx", "tx"))
            if name in tls_rows:
                extra_rx = {**extra_rx, **tls_config(certs, "decode")}
                extra_tx = {**extra_tx, **tls_config(certs, "prefill")}
            r = await rx.call("init", kind="tcp", layout=layout, num_blocks=nblocks, device=device,
                              config={**cfg, **extra_rx})
            t = await tx.call("init", kind="tcp", layout=layout, num_blocks=nblocks, device=device,
                              config={**cfg, **extra_tx})
            await tx.call("fill", tid=t["tid"], seed=1)
            sides[name] = (r["tid"], t["tid"], r["endpoint"])
            await _concurrent(rx, tx, sides[name], nblocks, 1, f"{name}-warm", args.fragment)
        raw = await rx.call("raw_listen", max_bytes=nbytes)
        cold = await rx.call("raw_listen", max_bytes=nbytes, slots=max(levels)) if args.raw_distinct else None
        plain_tid = sides["tcp"][1]
        for c in levels:
            # connections a row's transfers use: all of them when striped (a transfer of more than one
            # frame), else one per transfer in flight; the raw socket moves the same bytes over as many
            lanes = {}
            for name in sides:
                conf = {"tcp_connections": args.connections, "tcp_stripe": True,
                        **{k: v for k, v in variants.get(name, {}).items() if k != "tls"},
                        **_side(variants.get(name, {}), "tx")}
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
                            _process_knobs(rx, tx, variants.get(name, {})):
                        wall, per = await _concurrent(rx, tx, sides[name], nblocks, c, f"{name}-c{c}-{rep}",
                                                        args.fragment)
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
                row["fragment"] = args.fragment
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


def _side(variant: dict, side: str) -> dict:
    """The variant's overrides for one process only: ``rx.KEY`` (the receiver) or ``tx.KEY`` (the
    sender), e.g. ``--variant txinproc=tls=true,tx.tls_procs=0``: the sender's TLS on its connections'
    threads, the receiver's in relay helpers."""
    prefix = side + "."
    return {k[len(prefix):]: v for k, v in variant.items() if k.startswith(prefix)}


def _parse_variant(text: str) -> tuple[str, dict]:
    """NAME=key=value[,key=value...] -> (NAME, TransportConfig overrides, ``rx.``/``tx.``-prefixed ones
    for one side); values are JSON where they parse (numbers, true/false), else strings."""
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


# variant keys that are no TransportConfig field
_PROCESS_KNOBS = ("switch_interval", "busy_python", "busy_loop")


@contextlib.asynccontextmanager
async def _process_knobs(rx, tx, variant: dict):
    """Both peers run the block with the variant's process knobs, then as before: ``switch_interval``
    (sys.setswitchinterval) and ``busy_python`` (a thread spinning in Python beside the transport, as a
    worker's engine thread runs a step's host work: the GIL is then contended, as in serving) and
    ``busy_loop`` (the transport's event loop also runs other callbacks, ~1 ms of Python each, as a
    serving worker's loop runs its token streams: every turn the transport needs waits behind them;
    ``rx`` or ``tx`` for one side only: in a cluster it is the decode worker's loop that streams)."""
    seconds, busy = variant.get("switch_interval"), bool(variant.get("busy_python"))
    side = variant.get("busy_loop")
    loops = [p for p, name in ((rx, "rx"), (tx, "tx")) if side is True or side == name]
    old = None
    if seconds is not None:
        old = await asyncio.gather(rx.call("switch_interval", seconds=seconds),
                                   tx.call("switch_interval", seconds=seconds))
    if busy:
        await asyncio.gather(rx.call("busy_python", on=True), tx.call("busy_python", on=True))
    await asyncio.gather(*(p.call("busy_loop", on=True) for p in loops))
    try:
        yield
    finally:
        await asyncio.gather(*(p.call("busy_loop", on=False) for p in loops))
        if busy:
            await asyncio.gather(rx.call("busy_python", on=False), tx.call("busy_python", on=False))
        if old is not None:
            await asyncio.gather(rx.call("switch_interval", seconds=old[0]["old"]),
                                 tx.call("switch_interval", seconds=old[1]["old"]))


def _io_summary(io: dict, wall_s: float, conns: int) -> dict:
    """Per direction: KiB moved per syscall, the share of the I/O threads' time spent waiting in poll
    (plaintext moves whole frames per blocking call, iovec.whole_frame_io, so it waits inside the call:
    ~0 there), and how busy each connection's thread was (thread time over wall time x connections)."""
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


async def _concurrent(rx, tx, side, nblocks, c, tag, fragment: int = 0) -> tuple[float, list[float]]:
    """c transfers of nblocks started at once; (wall seconds, each one's seconds)."""
    rtid, ttid, endpoint = side
    rids = [f"{tag}-{i}" for i in range(c)]
    reply = await expect_send_wait(rx, tx, rtid, ttid, endpoint, nblocks, rids, "send_concurrent", fragment)
    return reply["seconds"], reply["each"]


def _conc_row(name, c, conns, ntok, nbytes, secs, each, raw, device) -> dict:
    gbps, raw_gbps = _gbps(nbytes * c, secs), _gbps(nbytes * c, raw)
    return {"backend": name, "concurrency": c, "connections": conns, "device": device, "tokens": ntok,
            "bytes": nbytes, "rounds": len(secs), "gbps": gbps,
            "gbps_best": round(nbytes * c / min(secs) / 1e9, 3),
            "baseline": "socket", "baseline_gbps": raw_gbps, "ratio": round(gbps / raw_gbps, 3),
            "transfer_ms_p50": round(statistics.median(each) * 1e3, 2),
            "transfer_ms_max": round(max(each) * 1e3, 2)}


HEAD_CONC = (f"{'backend':<8} {'conc':>4} {'conns':>5} {'tokens':>6} {'MiB each':>8} {'GB/s':>7} "
              f"{'socket GB/s':>11} {'ratio':>6} {'p50 ms':>9} {'max ms':>9} {'vs plain':>8} "
              f"{'distinct GB/s':>13} {'ratio':>6}")


def _fmt_conc(r: dict) -> str:
    vs = f"{r['tls_ratio']:>8.2f}" if "tls_ratio" in r else f"{'-':>8}"
    return (f"{r['backend']:<8} {r['concurrency']:>4} {r['connections']:>5} {r['tokens']:>6} "
            f"{r['bytes'] / 2**20:>8.1f} {r['gbps']:>7.3f} {r['baseline_gbps']:>11.3f} {r['ratio']:>6.2f} "
            f"{r['transfer_ms_p50']:>9.1f} {r['transfer_ms_max']:>9.1f} {vs} "
            f"{r.get('distinct_baseline_gbps') or 0:>13.3f} {r.get('distinct_ratio') or 0:>6.2f}")
