"""The ceiling for kvtransfer's NIXL path: raw NIXL WRITEs between two processes, no kvtransfer.

    rows = bench_raw(out, nbytes=512 << 20, device_tx="cuda:0", device_rx="cuda:1", env={}, tag="raw")

Two spawned processes (initiator "tx", target "rx") each register one ``nbytes`` region (VRAM on a
GPU, DRAM with ``device_*="cpu"``, which is how this runs on a machine without CUDA) with a NIXL
agent (UCX backend, no progress thread, telemetry on). The parent drives them over pipes; every
variant re-posts the same prepared handles (``transfer(handle)`` on a DONE handle) after 2 warm-ups:

    1desc           the whole region as ONE descriptor, one xfer -- the ceiling
    <N>desc         N equal pieces in one xfer, destination order permuted (nothing can merge):
                    32 = one per layer, 256, 8192 = one per (layer, block) of the 8B layout
    8192desc_contig 8192 pieces in address order on both sides (does NIXL/UCX merge them?)
    <K>xfers        K separate one-descriptor xfers posted back to back (does UCX run them in parallel?)
    1desc_fresh     initialize_xfer + transfer each time (descriptor preparation inside the timing)

Timing, all on CLOCK_MONOTONIC (one clock for both processes): ``post`` = the transfer() calls,
``done`` = post start -> every handle DONE (the initiator spins on check_xfer_state), ``notif`` =
post start -> the target saw the notification (it spins on get_new_notifs; the notification rides on
the last xfer). Byte-exactness: the target region is zeroed before each variant and compared after it
by a per-32-KiB checksum computed where the memory is.

``first_done_s`` is a variant's first post: for the pair's first variant it includes UCX mapping the
target's memory (cuda_ipc opens the IPC handle on first use and caches it, UCX_CUDA_IPC_CACHE).

``ipc_copy``: what is possible across two processes without NIXL/UCX: the target shares its region
through torch CUDA IPC (``torch.multiprocessing`` reductions over a pipe between the two children)
and the initiator copies into the mapped tensor with ``copy_`` (a peer memcpy), synchronizing both
devices around each copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
WARM = 2
# (name, descriptors, xfers, permute destination pieces, fresh handle per post)
VARIANTS = [
    ("1desc", 1, 1, False, False),
    ("32desc", 32, 1, True, False),
    ("256desc", 256, 1, True, False),
    ("8192desc", 8192, 1, True, False),
    ("8192desc_contig", 8192, 1, False, False),
    ("2xfers", 2, 2, False, False),
    ("4xfers", 4, 4, False, False),
    ("8xfers", 8, 8, False, False),
    ("32xfers", 32, 32, False, False),
    ("1desc_fresh", 1, 1, False, True),
]


def plan(nbytes: int, ndescs: int, nxfers: int, permute: bool,
         seed: int = 7) -> list[list[tuple[int, int, int]]]:
    """``nxfers`` lists of (src_offset, dst_offset, length) covering ``nbytes`` in ``ndescs`` equal pieces."""
    import random

    if ndescs % nxfers or nbytes % ndescs:
        raise ValueError(f"{nbytes} bytes do not split into {ndescs} pieces over {nxfers} xfers")
    piece = nbytes // ndescs
    order = list(range(ndescs))
    if permute and ndescs > 1:
        rng = random.Random(seed)
        while order == sorted(order):
            rng.shuffle(order)
    descs = [(i * piece, order[i] * piece, piece) for i in range(ndescs)]
    per = ndescs // nxfers
    return [descs[i * per:(i + 1) * per] for i in range(nxfers)]


def _checksum(t) -> str:
    """sha256 over per-32-KiB sums (two mixes): a misplaced or missing 32 KiB piece changes it."""
    import torch

    x = t.view(torch.int64).view(-1, 4096)
    a = x.sum(1)
    b = (x * 0x9E3779B1).bitwise_xor(x >> 13).sum(1)
    return hashlib.sha256(a.cpu().numpy().tobytes() + b.cpu().numpy().tobytes()).hexdigest()


def child_setup(env: dict, log_path: str | None) -> None:
    """First thing in a benchmark peer process: its environment (UCX_*), its output to the log file
    (UCX prints its protocol tables on stdout, NIXL logs on stderr: both go there), the repo on sys.path."""
    os.environ.update(env)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    sys.path.insert(0, ROOT)


def _peer(role: str, device: str, nbytes: int, env: dict, log_path: str | None, conn, side) -> None:
    child_setup(env, log_path)
    import torch
    import torch.multiprocessing  # noqa: F401  (registers the CUDA/shared-memory tensor reductions)

    from kvtransfer.nixl_backend import import_nixl

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    dev_id = (torch.device(device).index or 0) if cuda else 0

    def sync():
        if cuda:
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)

    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if not cuda:
        buf.share_memory_()  # before registering: sharing it later would move the storage
    if role == "tx":
        g = torch.Generator(device=device).manual_seed(1234)
        buf.random_(0, 256, generator=g)
    sync()
    agent_cls, config_cls, module = import_nixl()
    agent = agent_cls(f"raw-{role}-{os.getpid()}",
                      config_cls(enable_prog_thread=False, backends=["UCX"], capture_telemetry=True))
    mem = "VRAM" if cuda else "DRAM"
    base = buf.data_ptr()
    reg = agent.register_memory([(base, nbytes, dev_id, "")], mem)
    conn.send({"md": agent.get_agent_metadata(), "base": base, "dev": dev_id, "mem": mem, "module": module})
    remote = None
    rinfo: dict = {}
    handles: dict[str, list] = {}
    seen: list[bytes] = []

    def make(groups, tag: bytes) -> list:
        out = []
        for i, group in enumerate(groups):
            local = [(base + s, n, dev_id) for s, _d, n in group]
            far = [(rinfo["base"] + d, n, rinfo["dev"]) for _s, d, n in group]
            notif = tag if i == len(groups) - 1 else b""
            out.append(agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, mem),
                                             agent.get_xfer_descs(far, rinfo["mem"]), remote, notif))
        return out

    def progress() -> None:
        for msgs in agent.get_new_notifs().values():
            seen.extend(msgs)

    while True:
        # Idle: keep this UCX worker progressing (no progress thread): wire-up answers, and a
        # notification still queued after its WRITE reported DONE, leave only inside NIXL calls.
        while not conn.poll(0):
            progress()
            time.sleep(2e-5)
        cmd = conn.recv()
        op = cmd["op"]
        try:
            if op == "connect":  # tx: load the target's metadata, wire up with one notification
                rinfo = cmd["info"]
                remote = agent.add_remote_agent(rinfo["md"])
                remote = remote.decode() if isinstance(remote, bytes) else remote
                for attempt in range(200):
                    try:
                        agent.send_notif(remote, b"hello")
                        break
                    except Exception:
                        if attempt == 199:
                            raise
                        time.sleep(0.01)
                reply = {}
            elif op == "wait_notif":  # rx: spin until the tagged notification arrived
                tag, deadline = cmd["tag"].encode(), time.monotonic() + cmd.get("timeout", 30)
                while tag not in seen:
                    progress()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no notification {tag!r} within {cmd.get('timeout', 30)} s")
                t = time.monotonic()
                seen.remove(tag)
                reply = {"t": t}
            elif op == "prepare":  # tx
                t0 = time.perf_counter()
                handles[cmd["name"]] = make(cmd["groups"], cmd["tag"].encode())
                reply = {"init_s": time.perf_counter() - t0}
            elif op == "post":  # tx: post every handle of a variant, spin until all are DONE
                fresh = cmd.get("fresh")
                hs = make(cmd["groups"], cmd["tag"].encode()) if fresh else handles[cmd["name"]]
                t0 = time.monotonic()
                states = [agent.transfer(h) for h in hs]
                t_posted = time.monotonic()
                pending = [h for h, s in zip(hs, states, strict=True) if s != "DONE"]
                if "ERR" in states:
                    raise RuntimeError(f"transfer() returned {states}")
                deadline = t0 + 30
                while pending:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{len(pending)} xfer(s) still not DONE after 30 s")
                    nxt = []
                    for h in pending:
                        s = agent.check_xfer_state(h)
                        if s == "ERR":
                            raise RuntimeError("xfer failed (ERR)")
                        if s != "DONE":
                            nxt.append(h)
                    pending = nxt
                t_done = time.monotonic()
                tel = {}
                try:
                    x = agent.get_xfer_telemetry(hs[-1])
                    tel = {"post_us": x.postDuration, "xfer_us": x.xferDuration, "descs": x.descCount,
                           "bytes": x.totalBytes}
                except Exception as exc:  # telemetry is a diagnostic, not a requirement
                    tel = {"error": repr(exc)[:120]}
                if cmd.get("fresh"):
                    for h in hs:
                        agent.release_xfer_handle(h)
                reply = {"t0": t0, "post_s": t_posted - t0, "done_s": t_done - t0, "telemetry": tel}
            elif op == "release":
                for h in handles.pop(cmd["name"], []):
                    agent.release_xfer_handle(h)
                reply = {}
            elif op == "zero":
                buf.zero_()
                sync()
                reply = {}
            elif op == "digest":
                sync()
                reply = {"digest": _checksum(buf)}
            elif op == "digest_expected":  # tx: the checksum the target must have after these pieces
                expected = torch.zeros_like(buf)
                for group in cmd["groups"]:
                    for s, d, n in group:
                        expected[d:d + n] = buf[s:s + n]
                sync()
                reply = {"digest": _checksum(expected)}
                del expected
            elif op == "ipc_share":  # rx: hand the region to tx through torch's CUDA IPC / shared memory
                side.send(buf)
                reply = {}
            elif op == "ipc_copy":  # tx: copy into the shared region from this process
                dst = side.recv()
                times = []
                for i in range(WARM + cmd["reps"]):
                    sync()
                    t0 = time.perf_counter()
                    dst.copy_(buf)
                    sync()
                    if i >= WARM:
                        times.append(time.perf_counter() - t0)
                del dst
                reply = {"times": times}
            elif op == "exit":
                for hs in handles.values():
                    for h in hs:
                        agent.release_xfer_handle(h)
                agent.deregister_memory(reg)
                conn.send({})
                return
            else:
                reply = {"error": f"unknown op {op}"}
        except Exception as exc:  # reported to the parent, which records it for this variant
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)


class RawPair:
    def __init__(self, nbytes: int, device_tx: str, device_rx: str, env: dict | None = None,
                 log_dir: str | Path | None = None, tag: str = "raw") -> None:
        ctx = mp.get_context("spawn")
        self.nbytes = nbytes
        side_rx, side_tx = ctx.Pipe()
        self.conns, self.procs = {}, {}
        for role, dev, side in (("rx", device_rx, side_rx), ("tx", device_tx, side_tx)):
            parent, child = ctx.Pipe()
            log_path = str(Path(log_dir) / f"transfer-{tag}-{role}.log") if log_dir else None
            p = ctx.Process(target=_peer, args=(role, dev, nbytes, {"UCX_PROTO_INFO": "y", **(env or {})},
                                                log_path, child, side), daemon=True)
            p.start()
            self.conns[role], self.procs[role] = parent, p
        self.hello = {role: self._recv(role, 180) for role in ("rx", "tx")}
        self.call("rx", "wait_notif", tag="hello", timeout=60, _send_only=True)
        self.call("tx", "connect", info=self.hello["rx"])
        self._recv("rx", 90)

    def _recv(self, role: str, timeout: float = 60.0) -> dict:
        if not self.conns[role].poll(timeout):
            alive = self.procs[role].is_alive()
            raise TimeoutError(f"raw {role} peer silent for {timeout} s (alive={alive})")
        reply = self.conns[role].recv()
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"raw {role} peer: {reply['error']}")
        return reply

    def call(self, role: str, op: str, _send_only: bool = False, **kw) -> dict:
        self.conns[role].send({"op": op, **kw})
        return {} if _send_only else self._recv(role)

    def variant(self, name: str, ndescs: int, nxfers: int, permute: bool, fresh: bool, reps: int) -> dict:
        groups = plan(self.nbytes, ndescs, nxfers, permute)
        tag = f"v-{name}"
        self.call("rx", "zero")
        init = None if fresh else self.call("tx", "prepare", name=name, groups=groups, tag=tag)["init_s"]
        runs, first = [], None
        try:
            for i in range(WARM + reps):
                self.call("rx", "wait_notif", tag=tag, timeout=15, _send_only=True)
                try:
                    sent = self.call("tx", "post", name=name, fresh=fresh, groups=groups, tag=tag)
                except Exception:
                    with contextlib.suppress(Exception):  # the target's wait times out: keep in step
                        self._recv("rx", 30)
                    raise
                got = self._recv("rx")
                if first is None:  # the first post of this pair's handles (cold for the first variant)
                    first = sent["done_s"]
                if i >= WARM:
                    runs.append({**sent, "notif_s": got["t"] - sent["t0"]})
        finally:
            if not fresh:
                self.call("tx", "release", name=name)
        want = self.call("tx", "digest_expected", groups=groups)["digest"]
        exact = want == self.call("rx", "digest")["digest"]
        med = {k: statistics.median(r[k] for r in runs) for k in ("post_s", "done_s", "notif_s")}
        return {"descs": ndescs, "xfers": nxfers, "dst_permuted": permute, "fresh_handles": fresh,
                "init_s": init, **med, "first_done_s": first, "done_min_s": min(r["done_s"] for r in runs),
                "seconds": med["done_s"], "GBps": self.nbytes / med["done_s"] / 1e9,
                "notif_GBps": self.nbytes / med["notif_s"] / 1e9, "runs": len(runs), "byte_exact": exact,
                "telemetry": runs[-1]["telemetry"]}

    def ipc_copy(self, reps: int) -> dict:
        self.call("rx", "zero")
        self.call("rx", "ipc_share")
        times = self.call("tx", "ipc_copy", reps=reps)["times"]
        exact = self.call("tx", "digest")["digest"] == self.call("rx", "digest")["digest"]
        sec = statistics.median(times)
        return {"seconds": sec, "GBps": self.nbytes / sec / 1e9, "runs": len(times), "byte_exact": exact,
                "what": "torch copy_ from the initiator process into the target's tensor mapped by CUDA IPC"}

    def close(self) -> None:
        for role in ("tx", "rx"):
            try:
                self.call(role, "exit")
            except Exception:
                pass
            self.procs[role].join(10)
            if self.procs[role].is_alive():
                self.procs[role].kill()


def bench_raw(out: str | Path, *, nbytes: int, device_tx: str, device_rx: str, env: dict | None = None,
              tag: str = "raw", reps: int = 10, variants: list | None = None, ipc: bool = True) -> dict:
    """One process pair; every variant's row (or its error), plus the torch IPC copy when ``ipc``."""
    res: dict = {"env": env or {}, "nbytes": nbytes}
    t0 = time.perf_counter()
    try:
        pair = RawPair(nbytes, device_tx, device_rx, env=env, log_dir=out, tag=tag)
    except Exception as exc:
        return {**res, "error": f"{type(exc).__name__}: {exc}"}
    res["module"] = pair.hello["tx"].get("module")
    res["startup_s"] = time.perf_counter() - t0
    rows = {}
    try:
        for name, ndescs, nxfers, permute, fresh in variants or VARIANTS:
            try:
                rows[name] = pair.variant(name, ndescs, nxfers, permute, fresh, reps)
            except Exception as exc:
                rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if ipc:
            try:
                rows["ipc_copy"] = pair.ipc_copy(reps)
            except Exception as exc:
                rows["ipc_copy"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        pair.close()
    res["rows"] = rows
    res["wall_s"] = time.perf_counter() - t0
    return res
