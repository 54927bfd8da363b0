"""A KV-transfer peer in its own OS process, driven by JSON lines on stdin/stdout.

Used by the two-process integration tests and by the benchmark: the parent starts
``python -m bench.kv_peer_proc`` (possibly under ``ip netns exec`` or with ``UCX_TLS`` set), then sends
one JSON object per line ``{"id": n, "op": ..., ...}`` and reads ``{"id": n, "ok": true, ...}`` or
``{"id": n, "ok": false, "kind": ..., "error": ...}``. Commands run as concurrent tasks, so a ``wait``
does not block a later ``send``. Only JSON crosses the pipe.

ops: init (new transport; returns tid + endpoint), fill (seeded random KV), expect, wait, send, push,
finish, send_wait, send_many, send_concurrent, digest, stats, close, raw_listen (plain-socket baseline
receiver), raw_send, raw_send_concurrent, listening (this process's listening TCP sockets), cpu (CPU
seconds, per thread group too), switch_interval (sys.setswitchinterval), busy_python (a thread spinning in
Python on/off: the GIL contended as by a worker's engine thread), busy_loop (chores of ~1 ms on the
event loop on/off: the loop shared as with a worker's token streams), exit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time

import torch

from engine.kv_layout import KVLayout
from kvtransfer.errors import TransferError
from kvtransfer.transport import make_transport


def fill_random(kv: torch.Tensor, seed: int) -> None:
    """Deterministic random bytes in every block (the same seed gives the same cache anywhere)."""
    gen = torch.Generator().manual_seed(seed)
    raw = kv.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def block_digest(kv: torch.Tensor, blocks: list[int]) -> str:
    """sha256 over (every layer of) the given blocks, in the given order."""
    h = hashlib.sha256()
    for b in blocks:
        h.update(kv[:, b].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _spin(run: list[bool]) -> None:
    """Pure Python work until ``run[0]`` is False: holds the GIL as an engine thread's host work does."""
    while run[0]:
        x = 0
        for i in range(2000):
            x += i


async def _loop_chores(run: list[bool]) -> None:
    """~1 ms of Python, then yield to the loop, until ``run[0]`` is False: one of a serving worker's token
    streams as its event loop sees it (each turn of the loop runs every ready chore once)."""
    while run[0]:
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)


def _raw_server(nbytes_list_port: list, slots: int = 1) -> None:
    """Plain blocking socket receiver: per message, read an 8-byte length then that many bytes with
    recv_into into a preallocated buffer, reply one byte. The TCP baseline. Every accepted connection
    gets a thread of its own (the concurrent baseline moves bytes over several at once; the bytes are not
    looked at). slots > 1: that many buffers (pages touched up front), each message into the next one, so
    consecutive messages land in different memory as KV transfers do (slots=1: every message into the
    same, cache-warm buffer)."""
    import itertools

    import numpy as np

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((nbytes_list_port[0], 0))
    srv.listen(64)
    size = nbytes_list_port[1]
    whole = memoryview(np.ones(size * slots, dtype=np.uint8)) if slots > 1 else memoryview(bytearray(size))
    nbytes_list_port.append(srv.getsockname()[1])
    turn, lock = itertools.count(), threading.Lock()

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                with lock:
                    slot = next(turn) % slots
                buf = whole[slot * size:(slot + 1) * size]
                n, pos = int.from_bytes(head, "big"), 0
                while pos < n:
                    got = conn.recv_into(buf[pos:n])
                    if not got:
                        break
                    pos += got
                conn.sendall(b"k")

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _raw_send(kv: torch.Tensor, host: str, port: int, nbytes: int, iters: int) -> list[float]:
    """Plain blocking sendall of nbytes straight from the KV tensor's memory, one ack per message."""
    import time

    src = host_bytes(kv, nbytes)
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sock.sendall(nbytes.to_bytes(8, "big"))
        sock.sendall(src)
        if sock.recv(1) != b"k":
            raise ConnectionError("raw receiver went away")
        times.append(time.perf_counter() - t0)
    sock.close()
    return times


def listening_sockets() -> list[list]:
    """[host, port] of every TCP socket of this process in LISTEN state (/proc/net/tcp and tcp6, matched
    to this process's file descriptors by inode): what the KV plane's listeners (ours, UCX's) bound."""
    import ipaddress

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.append([str(ipaddress.ip_address(raw)), int(hexport, 16)])
    return out


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, grouped by Python thread name without its number
    ("kvtransfer-send_3" -> "kvtransfer-send", "MainThread" is the event loop); threads Python did not
    start (CUDA, UCX, the kernel's view of them) under "native". Threads that exited are not counted."""
    import re

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        group = re.sub(r"[_-]?\d+( \(\w+\))?$", "", names.get(int(tid), "native"))
        out[group] = round(out.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / tick, 3)
    return out


def proc_cpu(pid: int) -> float:
    """CPU seconds of another process of ours (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_HOST_COPY: dict[int, torch.Tensor] = {}
_DISTINCT: dict[tuple, torch.Tensor] = {}


def host_bytes(kv: torch.Tensor, nbytes: int) -> memoryview:
    """The first nbytes of the KV tensor as host memory: the tensor itself on CPU; for device memory a
    page-locked copy made once (the raw-socket baseline moves bytes over the socket only)."""
    if kv.device.type == "cpu":
        return memoryview(kv.view(-1).view(torch.uint8).numpy())[:nbytes]
    if nbytes not in _HOST_COPY:
        _HOST_COPY.clear()
        _HOST_COPY[nbytes] = kv.view(-1).view(torch.uint8)[:nbytes].cpu().pin_memory()
    return memoryview(_HOST_COPY[nbytes].numpy())


def _distinct_sources(kv: torch.Tensor, nbytes: int, count: int) -> list[memoryview]:
    """count different host buffers of nbytes, each a copy of the KV's first nbytes (page-locked for
    device memory), kept for the next call."""
    key = (nbytes, count)
    if key not in _DISTINCT:
        _DISTINCT.clear()
        first = kv.view(-1).view(torch.uint8)[:nbytes].cpu()
        pool = torch.empty(nbytes * count, dtype=torch.uint8, pin_memory=kv.device.type == "cuda")
        for i in range(count):
            pool[i * nbytes:(i + 1) * nbytes].copy_(first)
        _DISTINCT[key] = pool
    whole = memoryview(_DISTINCT[key].numpy())
    return [whole[i * nbytes:(i + 1) * nbytes] for i in range(count)]


def _raw_send_concurrent(kv: torch.Tensor, host: str, port: int, nbytes: int, conns: int,
                         messages: int, distinct: bool = False) -> float:
    """The concurrent baseline: ``messages`` messages of nbytes over ``conns`` connections, each a thread
    sending its equal share of the bytes back to back (a message split across connections where there
    are more connections than messages, as a striped transfer is); one 1-byte ack per piece; wall
    seconds from the first byte to the last ack. distinct: every message from its own host buffer (as
    transfers of different requests are), instead of all from one."""
    import time

    socks = [socket.create_connection((host, port)) for _ in range(conns)]
    barrier = threading.Barrier(conns + 1)
    errors: list[BaseException] = []
    sources = _distinct_sources(kv, nbytes, messages) if distinct else [host_bytes(kv, nbytes)] * messages
    share = -(-messages * nbytes // conns)
    pieces: list[list[memoryview]] = [[] for _ in range(conns)]
    pos = 0
    for src in sources:  # the bytes in order, cut into equal shares per connection
        at = 0
        while at < len(src):
            j = pos // share
            take = min(len(src) - at, (j + 1) * share - pos)
            pieces[j].append(src[at:at + take])
            at, pos = at + take, pos + take

    def run(sock: socket.socket, mine: list[memoryview]) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        barrier.wait()
        try:
            for piece in mine:
                sock.sendall(len(piece).to_bytes(8, "big"))
                sock.sendall(piece)
                if sock.recv(1) != b"k":
                    raise ConnectionError("raw receiver went away")
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, mine)) for s, mine in zip(socks, pieces, strict=True)]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    for s in socks:
        s.close()
    if errors:
        raise errors[0]
    return wall


_REPLIES = sys.stdout  # replaced by a private dup of fd 1 when run as a program


class PeerProcess:
    def __init__(self) -> None:
        self.transports: dict[int, object] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.sends: dict[str, object] = {}
        self.exps: dict[str, object] = {}
        self.out_lock = asyncio.Lock()
        self.busy: list[bool] | None = None  # busy_python: the spinning thread's run flag
        self.busy_loop: list[bool] | None = None  # busy_loop: the loop chores' run flag

    async def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "init":
            layout = KVLayout.from_dict(cmd["layout"])
            kv = layout.allocate(cmd["num_blocks"], device=cmd.get("device"))
            t = make_transport(cmd.get("kind", "auto"), layout, kv, **cmd.get("config", {}))
            await t.start()
            tid = len(self.transports) + 1
            self.transports[tid], self.tensors[tid] = t, kv
            return {"tid": tid, "endpoint": t.endpoint(), "backends": list(t.backends)}
        if op == "raw_listen":
            box = [cmd.get("host", "127.0.0.1"), cmd["max_bytes"]]
            threading.Thread(target=_raw_server, args=(box, cmd.get("slots", 1)), daemon=True).start()
            while len(box) < 3:
                await asyncio.sleep(0.005)
            return {"port": box[2]}
        if op == "switch_interval":  # the GIL's switch interval of this process (a benchmark variant)
            old = sys.getswitchinterval()
            sys.setswitchinterval(cmd["seconds"])
            return {"old": old}
        if op == "busy_python":
            if cmd["on"] and self.busy is None:
                self.busy = [True]
                threading.Thread(target=_spin, args=(self.busy,), daemon=True, name="busy-python").start()
            elif not cmd["on"] and self.busy is not None:
                self.busy[0], self.busy = False, None
            return {}
        if op == "busy_loop":
            if cmd["on"] and self.busy_loop is None:
                self.busy_loop = [True]
                for _ in range(4):  # four "streams": a turn of the loop runs ~4 ms of them
                    asyncio.get_running_loop().create_task(_loop_chores(self.busy_loop))
            elif not cmd["on"] and self.busy_loop is not None:
                self.busy_loop[0], self.busy_loop = False, None
            return {}
        if op == "listening":
            return {"sockets": listening_sockets()}
        if op == "cpu":
            times = os.times()
            threads = thread_cpu()
            relays = sum(proc_cpu(pid) for t in self.transports.values() if t.relays is not None
                         for pid in t.relays.pids())
            if relays:  # the TLS relay helpers (kvtransfer/tls_relay.py) are this process's children
                threads["tls-relays"] = round(relays, 3)
            return {"cpu_s": times.user + times.system + relays, "threads": threads}
        if op == "exit":
            for t in self.transports.values():
                await t.close()
            return {"bye": True}
        t, kv = self.transports[cmd["tid"]], self.tensors[cmd["tid"]]
        if op == "fill":
            fill_random(kv, cmd["seed"])
            return {}
        if op == "digest":
            blocks = cmd["blocks"]
            others = [b for b in range(kv.shape[1]) if b not in set(blocks)]
            untouched = bool((kv[:, others].view(-1).view(torch.uint8) == 0).all()) if others else True
            return {"digest": block_digest(kv, blocks), "others_zero": untouched}
        if op == "expect":
            self.exps[cmd["rid"]] = t.expect(cmd["rid"], cmd["dst"], timeout=cmd.get("timeout", 30.0))
            return {}
        if op == "wait":
            return {"result": await self.exps.pop(cmd["rid"]).wait()}
        if op == "send":
            self.sends[cmd["rid"]] = t.start_send(cmd["rid"], cmd["endpoint"], cmd["src"], cmd["dst"],
                                                  cmd.get("layers"), timeout=cmd.get("timeout"))
            return {}
        if op == "push":
            self.sends[cmd["rid"]].push_layers(cmd["layers"])
            return {}
        if op == "finish":
            self.sends[cmd["rid"]].finish()
            return {}
        if op == "send_wait":
            return {"result": await self.sends.pop(cmd["rid"]).wait()}
        if op == "send_many":
            times = []
            for rid in cmd["rids"]:
                handle = t.start_send(rid, cmd["endpoint"], cmd["src"], cmd["dst"],
                                      timeout=cmd.get("timeout"))
                result = await handle.wait()
                times.append(result["seconds"])
            return {"seconds": times, "backend": result["backend"]}
        if op == "send_concurrent":
            # Every rid started at once, each into the same dst (a benchmark: the bytes are not checked);
            # wall seconds from the first start_send to the last acknowledgement, plus each one's own.
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            handles = [t.start_send(rid, cmd["endpoint"], cmd["src"], cmd["dst"], timeout=cmd.get("timeout"))
                       for rid in cmd["rids"]]
            results = await asyncio.gather(*(h.wait() for h in handles))
            return {"seconds": loop.time() - t0, "each": [r["seconds"] for r in results],
                    "backend": results[0]["backend"]}
        if op == "raw_send_concurrent":
            return {"seconds": await asyncio.to_thread(_raw_send_concurrent, kv, cmd["host"], cmd["port"],
                                                       cmd["nbytes"], cmd["conns"], cmd["messages"],
                                                       cmd.get("distinct", False))}
        if op == "raw_send":
            return {"seconds": await asyncio.to_thread(_raw_send, kv, cmd["host"], cmd["port"], cmd["nbytes"],
                                                       cmd["iters"])}
        if op == "abort":
            return {"safe": await t.abort(cmd["rid"], cmd.get("reason", "test"))}
        if op == "stats":
            return {"stats": t.stats()}
        if op == "counters":
            return {"counters": t.counters()}
        if op == "close":
            await t.close()
            return {"stats": t.stats()}
        raise ValueError(f"unknown op {op!r}")

    async def run_one(self, cmd: dict) -> None:
        try:
            reply = {"id": cmd.get("id"), "ok": True, **await self.handle(cmd)}
        except TransferError as exc:
            reply = {"id": cmd.get("id"), "ok": False, "kind": type(exc).__name__, "code": exc.code,
                     "error": str(exc)}
        except Exception as exc:
            reply = {"id": cmd.get("id"), "ok": False, "kind": type(exc).__name__, "error": repr(exc)}
        async with self.out_lock:
            _REPLIES.write(json.dumps(reply) + "\n")
            _REPLIES.flush()
        if cmd.get("op") == "exit":
            os._exit(0)

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        _REPLIES.write(json.dumps({"id": 0, "ok": True, "pid": os.getpid()}) + "\n")
        _REPLIES.flush()
        tasks = set()
        while line := await reader.readline():
            task = loop.create_task(self.run_one(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for t in self.transports.values():
            await t.close()


if __name__ == "__main__":
    # Keep the JSON channel clean: NIXL/UCX print to fd 1, so replies go to a private dup of it and
    # fd 1 becomes stderr.
    _REPLIES = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=os.environ.get("KVTRANSFER_LOG", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s peer %(name)s %(levelname)s %(message)s")
    asyncio.run(PeerProcess().main())
