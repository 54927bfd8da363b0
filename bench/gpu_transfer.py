"""KV blocks between two GPU processes through ``kvtransfer`` (NIXL with VRAM registration, or TCP
staged through host memory), for the GPU test and for ``bench/gpu.py``'s transfer item.

    pair = TransferPair(layout, rx_device=1, tx_device=0, num_blocks=300, kind="nixl", log_dir=out)
    result = pair.transfer("r1", src=list(range(256)), dst=list(range(256)))   # {seconds, bytes, backend}
    pair.digest("tx", blocks) == pair.digest("rx", blocks)                      # byte-exact check
    pair.close()

Each side is its own OS process (``multiprocessing`` spawn): UCX only takes its CUDA IPC lane
between processes (one process holding both agents fell back to 0.5 GB/s). Both GPUs stay visible
to both processes (cuda_ipc maps the peer's memory by device); the process's own GPU is selected
with ``torch.cuda.set_device``. UCX's protocol selection is logged (``UCX_PROTO_INFO=y``) to each
side's stderr file under ``log_dir`` so the report can name the transports UCX picked.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def _peer(
    role: str,
    device: int,
    layout_dict: dict,
    num_blocks: int,
    kind: str,
    env: dict,
    log_path: str | None,
    conn,
    overrides: dict | None = None,
) -> None:
    os.environ.update(env)
    if log_path:  # UCX prints its protocol tables on stdout, NIXL logs on stderr: both to the file
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    sys.path.insert(0, ROOT)
    import torch

    from engine.kv_layout import KVLayout
    from kvtransfer import make_transport

    torch.cuda.set_device(device)
    layout = KVLayout.from_dict(layout_dict)
    kv = layout.allocate(num_blocks, device=f"cuda:{device}")
    if role == "tx":  # random bytes, on the device (never zeros: they hide unwritten blocks)
        g = torch.Generator(device=f"cuda:{device}").manual_seed(1234)
        kv.view(-1).view(torch.uint8).random_(0, 256, generator=g)
    torch.cuda.synchronize()

    async def main() -> None:
        t = await make_transport(kind, layout, kv, **(overrides or {})).start()
        conn.send({"endpoint": t.endpoint() if role == "rx" else None, "backends": list(t.backends)})
        pending = {}
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            op = cmd["op"]
            try:
                if op == "expect":
                    pending[cmd["rid"]] = t.expect(cmd["rid"], cmd["dst"], timeout=60)
                    reply = {}
                elif op == "wait":
                    reply = await pending.pop(cmd["rid"]).wait()
                elif op == "send":
                    reply = await t.start_send(
                        cmd["rid"], cmd["endpoint"], cmd["src"], cmd["dst"], timeout=60
                    ).wait()
                elif op == "digest":
                    torch.cuda.synchronize()
                    h = hashlib.sha256()
                    for b in cmd["blocks"]:
                        h.update(kv[:, b].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
                    others = sorted(set(range(num_blocks)) - set(cmd["blocks"]))
                    zero = bool((kv[:, others].view(-1).view(torch.uint8) == 0).all()) if others else True
                    reply = {"digest": h.hexdigest(), "others_zero": zero}
                elif op == "stats":
                    reply = t.stats()
                elif op == "exit":
                    await t.close()
                    conn.send({"stats": t.stats()})
                    return
                else:
                    reply = {"error": f"unknown op {op}"}
            except Exception as exc:  # reported to the parent, which raises
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            conn.send(reply)

    asyncio.run(main())


class TransferPair:
    def __init__(
        self,
        layout,
        *,
        rx_device: int,
        tx_device: int,
        num_blocks: int,
        kind: str = "nixl",
        env: dict | None = None,
        log_dir: str | Path | None = None,
        overrides: dict | None = None,
        tag: str | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.kind = kind
        tag = tag or kind
        base_env = {"UCX_PROTO_INFO": "y", **(env or {})}
        self.conns, self.procs = {}, {}
        for role, dev in (("rx", rx_device), ("tx", tx_device)):
            parent, child = ctx.Pipe()
            log_path = str(Path(log_dir) / f"transfer-{tag}-{role}.log") if log_dir else None
            p = ctx.Process(
                target=_peer,
                args=(role, dev, layout.to_dict(), num_blocks, kind, base_env, log_path, child, overrides),
                daemon=True,
            )
            p.start()
            self.conns[role], self.procs[role] = parent, p
        hello = {role: self._recv(role, 180) for role in ("rx", "tx")}
        self.endpoint = hello["rx"]["endpoint"]
        self.backends = hello

    def _recv(self, role: str, timeout: float = 120.0) -> dict:
        if not self.conns[role].poll(timeout):
            raise TimeoutError(
                f"{role} peer did not answer in {timeout} s (alive={self.procs[role].is_alive()})"
            )
        reply = self.conns[role].recv()
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"{role} peer: {reply['error']}")
        return reply

    def _call(self, role: str, **cmd) -> dict:
        self.conns[role].send(cmd)
        return self._recv(role)

    def transfer(self, rid: str, src: list[int], dst: list[int]) -> dict:
        """One request's blocks, tx -> rx; returns the sender's result plus the parent's wall seconds."""
        self._call("rx", op="expect", rid=rid, dst=dst)
        t0 = time.perf_counter()
        self.conns["rx"].send({"op": "wait", "rid": rid})
        self.conns["tx"].send({"op": "send", "rid": rid, "endpoint": self.endpoint, "src": src, "dst": dst})
        sent, got = self._recv("tx"), self._recv("rx")
        return {**sent, "wall_seconds": time.perf_counter() - t0, "rx_seconds": got["seconds"]}

    def digest(self, role: str, blocks: list[int]) -> dict:
        return self._call(role, op="digest", blocks=blocks)

    def close(self) -> dict:
        stats = {}
        for role in ("tx", "rx"):
            try:
                self.conns[role].send({"op": "exit"})
                stats[role] = self._recv(role, 30)["stats"]
            except Exception as exc:  # a dead peer: report, then make sure it is gone
                stats[role] = {"error": repr(exc)}
            self.procs[role].join(10)
            if self.procs[role].is_alive():
                self.procs[role].kill()
        return stats


def ucx_transports(log_dir: str | Path, kind: str = "nixl") -> list[str]:
    """UCX's protocol choices (UCX_PROTO_INFO tables) for operations that touch GPU memory, both sides:
    ``"<operation> :: <size range> <protocol> <transport>"``."""
    out, title = [], None
    for role in ("tx", "rx"):
        path = Path(log_dir) / f"transfer-{kind}-{role}.log"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            cells = [c.strip() for c in line.split("|")[1:-1] if c.strip()]
            if len(cells) == 1 and "ucp_" in cells[0]:
                title = cells[0] if "cuda" in cells[0] else None
            elif title and len(cells) == 3 and cells[0] != "Range":
                entry = f"{role}: {title} :: {' '.join(cells)}"
                if entry not in out:
                    out.append(entry)
    return out[:40]


def bench_transfer(out: str | Path, *, quick: bool = False, tokens: int = 4096,
                   transfer_variants: bool = False) -> dict:
    """A ``tokens``-token KV of the llama3-8b shape (512 MiB at 4k) GPU0 -> GPU1 (or GPU0 -> GPU0 on a
    one-GPU machine) through NIXL and through the TCP fallback, each side its own process, against a
    plain device-to-device copy of the same bytes measured in the same run (median of repeats)."""
    import statistics

    import torch

    from engine.kv_layout import KVLayout

    layout = KVLayout(
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype="bfloat16",
        memory="cuda",
        model_fingerprint="bench-llama3-8b",
    )
    blocks = tokens // layout.block_size
    nbytes = layout.num_layers * blocks * layout.block_bytes
    rx_dev = 1 if torch.cuda.device_count() > 1 else 0
    src_t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst_t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rx_dev}")
    times = []
    for i in range(25):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(rx_dev)
        t0 = time.perf_counter()
        dst_t.copy_(src_t)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(rx_dev)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    direct_s = statistics.median(times)
    del src_t, dst_t
    torch.cuda.empty_cache()
    res = {
        "tokens": tokens,
        "bytes": nbytes,
        "src_device": 0,
        "dst_device": rx_dev,
        "direct_copy": {
            "seconds": direct_s,
            "GBps": nbytes / direct_s / 1e9,
            "what": f"torch copy_ cuda:0 -> cuda:{rx_dev}, contiguous, same process",
        },
    }
    src, dst = list(range(blocks)), list(range(8, 8 + blocks))
    reps = 5 if quick else 15
    variants = [  # (result key, kind, TransportConfig overrides, repeats); "nixl" is the services' default
        ("nixl", "nixl", {}, reps),
        ("tcp", "tcp", {}, 2 if quick else 3),
    ]
    if transfer_variants:
        variants[1:1] = [("nixl_progress_thread", "nixl", {"nixl_progress_thread": True}, reps),
                         ("nixl_poll_50us", "nixl", {"nixl_poll_interval_s": 5e-5}, reps),
                         # descriptors built per request instead of prepared once per peer
                         ("nixl_unprepped", "nixl", {"nixl_prepped": False}, reps)]
    for key, kind, overrides, reps in variants:
        try:
            pair = TransferPair(layout, rx_device=rx_dev, tx_device=0, num_blocks=blocks + 16, kind=kind,
                                log_dir=out, overrides=overrides, tag=key)
        except Exception as exc:
            res[key] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        try:
            for i in range(2):
                pair.transfer(f"{key}-warm-{i}", src, dst)
            runs = [pair.transfer(f"{key}-{i}", src, dst) for i in range(reps)]
            exact = pair.digest("tx", src)["digest"] == pair.digest("rx", dst)["digest"]
            sec = statistics.median(r["seconds"] for r in runs)
            res[key] = {
                "seconds": sec,
                "GBps": nbytes / sec / 1e9,
                "runs": len(runs),
                "rx_seconds": statistics.median(r["rx_seconds"] for r in runs),
                "wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
                "backend": runs[0]["backend"],
                "byte_exact": exact,
                "fraction_of_direct_copy": direct_s / sec,
                "config_overrides": overrides,
            }
            print(
                f"  {key}: {nbytes / 2**20:.0f} MiB in {sec * 1e3:.2f} ms = {nbytes / sec / 1e9:.1f} GB/s "
                f"({direct_s / sec:.1%} of the direct copy), byte-exact={exact}",
                flush=True,
            )
        except Exception as exc:
            res[key] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            pair.close()
    res["ucx_transports"] = ucx_transports(out, "nixl")
    res["goal"] = {
        "nixl_fraction_of_direct_copy": res.get("nixl", {}).get("fraction_of_direct_copy"),
        "target": 0.85,
    }
    return res
