"""How a socket-reading thread fares beside a thread running Python: the GIL's cost to KV receives.

    python3 bench/gil_probe.py [--gib 2] [--json OUT.json]

A sender process writes ``--gib`` GiB over loopback; this process receives it on a thread, either with
non-blocking ``readv`` + ``poll`` (one return from the kernel, and so one wait for the GIL, per
socket-buffer fill: how kvtransfer's receive threads read before ``iovec.whole_frame_io``) or with a
blocking ``recvmsg_into(..., MSG_WAITALL)`` of whole 16 MiB frames (how they read now). Each runs with the
main thread idle, and with it spinning in Python (a worker's engine thread) at Python's default switch
interval (5 ms) and at 0.5 ms (``TransportConfig.gil_switch_interval_s``). Prints GB/s, KiB per call
and the spinning thread's progress (loops per second), and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path

FRAME = 16 << 20


def _send(port: int, total: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, sent = memoryview(bytearray(FRAME)), 0
    while sent < total:
        sent += s.send(buf[:min(FRAME, total - sent)])
    s.close()


def _readv(sock: socket.socket, view: memoryview, total: int) -> tuple[int, int]:
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    n = calls = 0
    while n < total:
        try:
            got = os.readv(sock.fileno(), [view])
        except BlockingIOError:
            poller.poll(100)
            continue
        if got == 0:
            break
        n, calls = n + got, calls + 1
    return n, calls


def _waitall(sock: socket.socket, view: memoryview, total: int) -> tuple[int, int]:
    sock.setblocking(True)
    n = calls = 0
    while n < total:
        got = sock.recvmsg_into([view[:min(FRAME, total - n)]], 0, socket.MSG_WAITALL)[0]
        if got == 0:
            break
        n, calls = n + got, calls + 1
    return n, calls


def run(mode: str, spin: bool, interval: float, total: int) -> dict:
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    ls = socket.create_server(("127.0.0.1", 0))
    sender = mp.get_context("spawn").Process(target=_send, args=(ls.getsockname()[1], total))
    sender.start()
    conn, _ = ls.accept()
    view = memoryview(bytearray(FRAME))
    out: dict = {}

    def receive() -> None:
        t = time.perf_counter()
        out["bytes"], out["calls"] = (_readv if mode == "readv" else _waitall)(conn, view, total)
        out["seconds"] = time.perf_counter() - t

    th = threading.Thread(target=receive)
    th.start()
    loops = 0
    while spin and th.is_alive():
        x = 0
        for i in range(1000):
            x += i
        loops += 1
    th.join()
    sender.join()
    conn.close()
    ls.close()
    sys.setswitchinterval(old)
    return {"mode": mode, "spinning_thread": spin, "switch_interval_ms": interval * 1e3,
            "gbps": round(out["bytes"] / out["seconds"] / 1e9, 3),
            "kib_per_call": round(out["bytes"] / max(1, out["calls"]) / 1024),
            "spin_loops_per_s": round(loops / out["seconds"]) if spin else None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    total = int(args.gib * (1 << 30))
    rows = []
    for mode in ("readv", "waitall"):
        for spin, interval in ((False, 0.005), (True, 0.005), (True, 0.0005)):
            rows.append(run(mode, spin, interval, total))
            r = rows[-1]
            print(f"{mode:8s} spinning={str(spin):5s} switch {r['switch_interval_ms']:.1f} ms  "
                  f"{r['gbps']:6.2f} GB/s  {r['kib_per_call']:7d} KiB/call  "
                  f"spin loops/s {r['spin_loops_per_s']}", flush=True)
    if args.json:
        command = "python3 bench/gil_probe.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
