"""How fast the TCP path's staging copies can go on this host, alone and beside a socket blast.

The TCP KV path stages device memory through page-locked host buffers (kvtransfer/memory.py): each
DATA frame is a device->host copy on the sender and a host->device copy on the receiver, on one side
stream per process. This probe times those copies by themselves (frames of ``--frame-mib`` from a
256 MiB device tensor, one stream, each frame into a page-locked buffer from torch's caching host
allocator, as the transport takes them), then again while ``--blast`` socket pairs move host memory
on other threads (the socket copies compete with the DMA for host memory bandwidth). If a direction's
rate is near what the transport moves, staging sets the pace. ``issue_ms`` is the host thread's time
to issue every frame's copy: each torch call takes the GIL back, so beside busy socket threads (the
lanes are such threads) many small frames cost the issuing thread far more than a few large ones.

    python -m bench.staging_probe --out bench/results   # on a GPU host; prints a table, writes JSON
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import torch


def _copy_rate(direction: str, frame: int, total: int, streams: int, rounds: int) -> dict:
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pool = [torch.cuda.Stream(priority=-1) for _ in range(streams)]
    rates, issues = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events, bufs = [], []
        for i, off in enumerate(range(0, total, frame)):
            host = torch.empty(frame, dtype=torch.uint8, pin_memory=True)
            s = pool[i % streams]
            with torch.cuda.stream(s):
                if direction == "d2h":
                    host.copy_(dev[off:off + frame], non_blocking=True)
                else:
                    dev[off:off + frame].copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s)
            events.append(ev)
            bufs.append(host)
        issues.append((time.perf_counter() - t0) * 1e3)  # the host thread's time to issue every copy
        for ev in events:
            ev.synchronize()
        rates.append(total / (time.perf_counter() - t0) / 1e9)
    return {"gbps": round(statistics.median(rates), 2), "gbps_best": round(max(rates), 2),
            "issue_ms": round(statistics.median(issues), 3)}


class _Blast:
    """``n`` loopback socket pairs moving host memory flat out on threads (what the lanes do)."""

    def __init__(self, n: int, chunk: int) -> None:
        self.n, self.chunk, self.stop, self.bytes = n, chunk, threading.Event(), 0
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        self._lock = threading.Lock()

    def _send(self, s: socket.socket) -> None:
        buf = bytearray(self.chunk)
        try:
            while not self.stop.is_set():
                s.sendall(buf)
        except OSError:
            pass

    def _recv(self, s: socket.socket) -> None:
        buf = bytearray(self.chunk)
        view = memoryview(buf)
        try:
            while not self.stop.is_set():
                got = s.recv_into(view)
                if not got:
                    return
                with self._lock:
                    self.bytes += got
        except OSError:
            pass

    def __enter__(self) -> _Blast:
        lst = socket.create_server(("127.0.0.1", 0))
        for _ in range(self.n):
            a = socket.create_connection(lst.getsockname())
            b, _ = lst.accept()
            self.socks += [a, b]
            self.threads += [threading.Thread(target=self._send, args=(a,), daemon=True),
                             threading.Thread(target=self._recv, args=(b,), daemon=True)]
        lst.close()
        for t in self.threads:
            t.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.gbps = self.bytes / (time.perf_counter() - self.t0) / 1e9
        self.stop.set()
        for s in self.socks:
            s.close()
        for t in self.threads:
            t.join(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frame-mib", default="2,16", help="frame sizes (MiB), comma-separated")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--blast", type=int, default=8, help="socket pairs beside the copies (0: none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    total = args.total_mib << 20
    rows = []
    for blast in sorted({0, args.blast}):
        for frame_mib in (int(x) for x in args.frame_mib.split(",")):
            for direction in ("d2h", "h2d"):
                for streams in (1, 2):
                    _copy_rate(direction, frame_mib << 20, total, streams, 1)  # warm the host allocator
                    if blast:
                        with _Blast(blast, 4 << 20) as b:
                            r = _copy_rate(direction, frame_mib << 20, total, streams, args.rounds)
                        r["blast_gbps"] = round(b.gbps, 2)
                    else:
                        r = _copy_rate(direction, frame_mib << 20, total, streams, args.rounds)
                    rows.append({"direction": direction, "frame_mib": frame_mib, "streams": streams,
                                 "blast_pairs": blast, **r})
                    print(f"{direction} frame {frame_mib:3d} MiB streams {streams} blast {blast}: "
                          f"{r['gbps']:6.2f} GB/s (best {r['gbps_best']:.2f}), issued in "
                          f"{r['issue_ms']:.3f} ms"
                          + (f", blast {r['blast_gbps']:.2f} GB/s" if blast else ""))
    if args.out:
        out = Path(args.out) / "staging-probe.json"
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "total_mib": args.total_mib,
                                   "rows": rows}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
