"""Two GPU processes with a ``kvtransfer`` transport each (NIXL with VRAM registration, or TCP staged
through host memory): the harness of the GPU transfer benchmark (``gpu_transfer.py``) and of
``tests/gpu/test_nixl_vram.py``.

    pair = TransferPair(layout, rx_device=1, tx_device=0, num_blocks=300, kind="nixl", log_dir=out)
    result = pair.transfer("r1", src=list(range(256)), dst=list(range(256)))   # {seconds, bytes, backend}
    pair.digest("tx", blocks) == pair.digest("rx", blocks)                      # byte-exact check
    pair.close()

Each side is its own OS process (``multiprocessing`` spawn): UCX only takes its CUDA IPC lane
between processes (one process holding both agents fell back to 0.5 GB/s). Both GPUs stay visible
to both processes (cuda_ipc maps the peer's memory by device); the process's own GPU is selected
with ``torch.cuda.set_device``. UCX's protocol selection is logged (``UCX_PROTO_INFO=y``) to each
side's stderr file under ``log_dir`` so the report can name the transports UCX picked.
``transfer(..., preopened=True)``: see ``gpu_transfer``'s docstring.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path


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
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_nixl_raw import child_setup

    child_setup(env, log_path)
    import torch

    from engine.kv_layout import KVLayout
    from kvtransfer import make_transport

    dev = "cpu" if device == "cpu" else f"cuda:{device}"
    cuda = dev != "cpu"
    if cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    layout = KVLayout.from_dict(layout_dict)
    kv = layout.allocate(num_blocks, device=dev)
    if role == "tx":  # random bytes, on the device (never zeros: they hide unwritten blocks)
        g = torch.Generator(device=dev).manual_seed(1234)
        kv.view(-1).view(torch.uint8).random_(0, 256, generator=g)
    sync()

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
                    exp = pending.pop(cmd["rid"])
                    reply = await exp.wait()
                    reply["t_done"] = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
                    reply["timeline"] = dict(getattr(exp, "timeline", {}))
                elif op == "send":
                    t0 = time.monotonic()
                    h = t.start_send(cmd["rid"], cmd["endpoint"], cmd["src"], cmd["dst"], timeout=60)
                    reply = await h.wait()
                    reply["t_start"] = t0
                    reply["timeline"] = dict(getattr(h, "timeline", {}))
                elif op == "send_preopened":  # open, await BEGIN_OK (TCP: BEGIN written), then time it
                    h = t.start_send(cmd["rid"], cmd["endpoint"], cmd["src"], cmd["dst"], layers=(),
                                     timeout=60)
                    await h.begun()
                    t0 = time.monotonic()
                    h.push_layers(range(layout.num_layers), final=True)
                    reply = await h.wait()
                    reply["t_start"] = t0
                    reply["timeline"] = {**h.timeline, "push": t0}
                    reply["seconds"] = h.timeline.get("acked", time.monotonic()) - t0
                elif op == "zero":
                    kv.zero_()
                    sync()
                    reply = {}
                elif op == "digest":
                    sync()
                    # One gather in block order (as many bytes as the transfer), one copy to the host.
                    idx = torch.tensor(cmd["blocks"], dtype=torch.long, device=kv.device)
                    sel = kv.index_select(1, idx).contiguous().view(-1).view(torch.uint8)
                    h = hashlib.sha256(sel.cpu().numpy())
                    del sel
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

    def transfer(self, rid: str, src: list[int], dst: list[int], preopened: bool = False) -> dict:
        """One request's blocks, tx -> rx; returns the sender's result plus the parent's wall seconds.
        ``preopened``: the send is opened and BEGIN_OK awaited before its clock starts (module docstring)."""
        self._call("rx", op="expect", rid=rid, dst=dst)
        t0 = time.perf_counter()
        self.conns["rx"].send({"op": "wait", "rid": rid})
        op = "send_preopened" if preopened else "send"
        self.conns["tx"].send({"op": op, "rid": rid, "endpoint": self.endpoint, "src": src, "dst": dst})
        sent, got = self._recv("tx"), self._recv("rx")
        # Every step of both sides in seconds after start_send, or after the push of a preopened send (one
        # CLOCK_MONOTONIC for both processes).
        steps = {f"tx_{k}": v - sent["t_start"] for k, v in sent.get("timeline", {}).items()}
        steps.update({f"rx_{k}": v - sent["t_start"] for k, v in got.get("timeline", {}).items()})
        return {**sent, "wall_seconds": time.perf_counter() - t0, "rx_seconds": got["seconds"],
                "rx_done_after_start_s": got["t_done"] - sent["t_start"], "steps": steps}

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
