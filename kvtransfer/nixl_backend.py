"""The NIXL side of a transport: one agent per process, the whole KV tensor registered once.

Lifecycle::

    NixlAgent(name, memory)            import nixl (the nixl_cu12 or nixl_cu13 wheel, or the `nixl`
                                       meta-package's nixl._api), create the agent with the UCX backend,
                                       register the KV tensor (DRAM on CPU, VRAM on GPU) and prepare its
                                       descriptor list (one descriptor per (layer, block)) -- once, for
                                       the transport's lifetime
    info()                             what the receiver sends in HELLO_OK: agent metadata (base64),
                                       base address, length, device id, memory type
    add_remote(info) / remove_remote   sender side; refcounted per remote agent (one per cached peer);
                                       the remote's (layer, block) descriptor list is prepared once here
    post_blocks(...)                   one-sided WRITE of (layer, src block) -> (layer, dst block) pairs
                                       by index into the two prepared lists (NIXL merges neighbours), one
                                       transfer for everything passed in, optionally carrying a
                                       notification; post_write(...) is the unprepared fallback;
                                       make_blocks_xfer + post: the same WRITE made ahead, posted later
    state(xfer) / release(xfer)        poll DONE / PROC / ERR; release cancels what is still in flight
    send_notif / poll_notifs           completion and probe notifications (small JSON, see protocol.py)
    close()                            release every handle and prepared list, forget remote agents,
                                       deregister memory

All methods are non-blocking C calls made from the transport's event loop thread. Without NIXL's
progress thread (the default: it spins a core), UCX moves bytes only inside these calls, so the
transport polls them (see sender.py / receiver.py for how often).
"""

from __future__ import annotations

import base64
import logging
import os

import numpy as np

from .errors import BackendUnavailable, PeerUnavailable, TransferError
from .memory import KVMemory

log = logging.getLogger("kvtransfer.nixl")


def import_nixl():
    """(nixl_agent, nixl_agent_config, module name); BackendUnavailable naming every import failure."""
    errors = []
    # nixl_cu12 / nixl_cu13 are the CUDA-flavoured wheels (CPU machines get cu12 from PyPI, the GPU
    # image the cu13 one); nixl._api is what the `nixl` meta-package re-exports.
    for modname in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            mod = __import__(modname, fromlist=["nixl_agent", "nixl_agent_config"])
            return mod.nixl_agent, mod.nixl_agent_config, modname
        except Exception as exc:  # ImportError, or a broken native library (OSError)
            errors.append(f"{modname}: {type(exc).__name__}: {exc}")
    raise BackendUnavailable("NIXL is not importable (" + "; ".join(errors) + ")")



def apply_ucx_env(ucx_env: tuple[tuple[str, str], ...]) -> None:
    """Set UCX variables in this process's C environment, where UCX reads them (getenv) when the agent's
    context is created. pdserve/settings.py decides them (TransportConfig.ucx_env): e.g. UCX_PROTO_INFO=y,
    so a worker's log shows which transport UCX picks per operation and memory type (``zero-copy
    cuda_ipc/cuda``, an RDMA lane, or the thing to notice, ``software emulation tcp``), and
    UCX_NET_DEVICES, so UCX's TCP listeners bind the KV host's interface only."""
    for name, value in ucx_env:
        os.putenv(name, value)


class NixlAgent:
    def __init__(self, name: str, memory: KVMemory, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = False, prepped: bool = True,
                 ucx_env: tuple[tuple[str, str], ...] = ()) -> None:
        agent_cls, config_cls, self.module = import_nixl()
        self.name = name
        self.memory = memory
        apply_ucx_env(ucx_env)
        try:
            conf = config_cls(enable_prog_thread=progress_thread, backends=list(backends))
            self.agent = agent_cls(name, conf)
        except Exception as exc:
            raise BackendUnavailable(f"NIXL agent creation failed: {type(exc).__name__}: {exc}") from exc
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise BackendUnavailable(f"NIXL backends {missing} unavailable "
                                     f"(plugins: {self.agent.get_plugin_list()})")
        self.mem_type = memory.nixl_mem_type
        try:
            self._reg = self.agent.register_memory(
                [(memory.base_address, memory.nbytes, memory.device_id, "")], self.mem_type)
        except Exception as exc:
            raise BackendUnavailable(f"NIXL could not register {memory.nbytes} bytes of {self.mem_type}: "
                                     f"{type(exc).__name__}: {exc}") from exc
        self._remotes: dict[str, int] = {}
        self._xfers: set = set()
        # Prepared descriptor lists: ours (made here) and one per remote agent (made in add_remote).
        self._local_dlist = None
        self._remote_dlists: dict[str, object] = {}
        self.prep_error = ""
        self.prep_kind = ""  # "strided" (one row per layer) or "expanded" (one row per descriptor)
        if prepped:
            try:
                self._local_dlist = self._prep("NIXL_INIT_AGENT", memory.base_address, memory.num_blocks,
                                               memory.device_id, self.mem_type)
            except Exception as exc:  # an older NIXL without prepped lists: per-request descriptors
                self.prep_error = f"{type(exc).__name__}: {exc}"
                log.warning("NIXL prepared descriptor lists unavailable, building descriptors per "
                            "request: %s", self.prep_error)
        self._closed = False
        # Cumulative (never reset; not leak counters): WRITEs posted and descriptors they carried.
        self.posted_xfers = 0
        self.posted_descs = 0
        log.info("NIXL agent %s (%s, UCX settings %s) registered %d bytes of %s", name, self.module,
                 dict(ucx_env) or "from the environment", memory.nbytes, self.mem_type)

    def _prep(self, agent: str, base: int, num_blocks: int, dev: int, mem: str):
        """A prepared list with one descriptor per (layer, block): index = layer * num_blocks + block.

        One strided row per layer (address, length, device, stride, count) keeps the list small to hand
        over; the layout is [layers, blocks, ...], so index order is address order and neighbouring
        indices are neighbouring bytes (NIXL merges them into one descriptor when a transfer is made)."""
        bb, layers = self.memory.block_bytes, self.memory.layout.num_layers
        rows = np.empty((layers, 5), dtype=np.uint64)
        rows[:, 0] = base + np.arange(layers, dtype=np.uint64) * np.uint64(num_blocks * bb)
        rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = bb, dev, bb, num_blocks
        try:
            handle = self.agent.prep_xfer_dlist(agent, rows, mem)
            self.prep_kind = "strided"
            return handle
        except Exception as exc:  # strided lists are recent: the same list, one row per descriptor
            log.debug("strided prep_xfer_dlist failed (%s); expanding", exc)
            idx = np.arange(layers * num_blocks, dtype=np.uint64)
            full = np.empty((layers * num_blocks, 3), dtype=np.uint64)
            full[:, 0], full[:, 1], full[:, 2] = base + idx * np.uint64(bb), bb, dev
            self.prep_kind = "expanded"
            return self.agent.prep_xfer_dlist(agent, full, mem)

    # -- metadata exchange -------------------------------------------------------------------------
    def info(self) -> dict:
        return {"agent": self.name, "md": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "base": self.memory.base_address, "nbytes": self.memory.nbytes,
                "dev": self.memory.device_id, "mem": self.mem_type}

    def add_remote(self, info: dict) -> str:
        try:
            md = base64.b64decode(info["md"], validate=True)
            name = self.agent.add_remote_agent(md)
        except Exception as exc:
            raise PeerUnavailable(f"loading NIXL metadata of {info.get('agent')!r} failed: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes[name] = self._remotes.get(name, 0) + 1
        if self._local_dlist is not None and name not in self._remote_dlists:
            bb, layers = self.memory.block_bytes, self.memory.layout.num_layers
            blocks, rest = divmod(int(info["nbytes"]), bb * layers)
            try:
                if rest or blocks <= 0:
                    raise ValueError(f"remote region of {info['nbytes']} bytes is not whole blocks")
                self._remote_dlists[name] = self._prep(name, int(info["base"]), blocks, int(info["dev"]),
                                                       str(info["mem"]))
            except Exception as exc:  # still usable: descriptors per request for this peer (post_write)
                log.warning("NIXL: preparing descriptors of %s failed, building them per request: %s",
                            name, exc)
        return name

    def remove_remote(self, name: str) -> None:
        count = self._remotes.get(name, 0) - 1
        if count > 0:
            self._remotes[name] = count
            return
        self._remotes.pop(name, None)
        dlist = self._remote_dlists.pop(name, None)
        if dlist is not None:
            self._release_dlist(dlist)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # already gone (peer died): nothing left to free
            log.debug("remove_remote_agent(%s): %s", name, exc)

    def _release_dlist(self, dlist) -> None:
        try:
            self.agent.release_dlist_handle(dlist)
        except Exception as exc:
            log.debug("release_dlist_handle: %s", exc)

    # -- transfers ---------------------------------------------------------------------------------
    def post_write(self, remote: str, remote_base: int, remote_dev: int, remote_mem: str,
                   regions: list[tuple[int, int, int]], notif: bytes = b""):
        """WRITE (local_offset, remote_offset, length) regions; returns (handle, state)."""
        n = len(regions)
        local = np.empty((n, 3), dtype=np.uint64)
        remote_d = np.empty((n, 3), dtype=np.uint64)
        base = self.memory.base_address
        for i, (lo, ro, ln) in enumerate(regions):
            local[i] = (base + lo, ln, self.memory.device_id)
            remote_d[i] = (remote_base + ro, ln, remote_dev)
        try:
            ldescs = self.agent.get_xfer_descs(local, self.mem_type)
            rdescs = self.agent.get_xfer_descs(remote_d, remote_mem)
            handle = self.agent.initialize_xfer("WRITE", ldescs, rdescs, remote, notif)
        except Exception as exc:
            raise PeerUnavailable(f"NIXL could not prepare a WRITE to {remote}: {exc}") from exc
        return self._post(handle, remote, n)

    def _post(self, handle, remote: str, ndescs: int):
        self._xfers.add(handle)
        self.posted_xfers += 1
        self.posted_descs += ndescs
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:
            self.release(handle)
            raise PeerUnavailable(f"NIXL WRITE to {remote} failed to post: {exc}") from exc
        if state == "ERR":
            self.release(handle)
            raise PeerUnavailable(f"NIXL WRITE to {remote} failed to post (ERR)")
        return handle, state

    def can_post_blocks(self, remote: str) -> bool:
        return remote in self._remote_dlists

    def post_blocks(self, remote: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes = b""):
        """ONE WRITE of prepared descriptors by index (see _prep); returns (handle, state)."""
        handle, ndescs = self.make_blocks_xfer(remote, local_idx, remote_idx, notif)
        return self.post(handle, remote, ndescs)

    def make_blocks_xfer(self, remote: str, local_idx: np.ndarray, remote_idx: np.ndarray,
                         notif: bytes = b"") -> tuple[object, int]:
        """A WRITE of prepared descriptors by index, made but not posted: (handle, descriptors after
        merging). ``post`` it later (it is tracked from now on: ``release`` or ``close`` frees it)."""
        rdlist = self._remote_dlists.get(remote)
        if rdlist is None or self._local_dlist is None:
            raise PeerUnavailable(f"no prepared NIXL descriptors for {remote}")
        try:
            handle = self.agent.make_prepped_xfer("WRITE", self._local_dlist, local_idx, rdlist, remote_idx,
                                                  notif)
        except Exception as exc:
            raise PeerUnavailable(f"NIXL could not prepare a WRITE to {remote}: {exc}") from exc
        self._xfers.add(handle)
        # Counted as NIXL will post them: neighbours on both sides merge into one descriptor.
        joined = (np.diff(local_idx) == 1) & (np.diff(remote_idx) == 1)
        return handle, int(len(local_idx) - np.count_nonzero(joined))

    def post(self, handle, remote: str, ndescs: int):
        """Post a WRITE made by ``make_blocks_xfer``; returns (handle, state)."""
        return self._post(handle, remote, ndescs)

    def state(self, handle) -> str:
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as exc:
            log.debug("check_xfer_state: %s", exc)
            return "ERR"

    def release(self, handle) -> bool:
        """Release a handle (cancelling it if still in flight). False if NIXL refused: still active."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            log.debug("release_xfer_handle: %s", exc)
            return False
        self._xfers.discard(handle)
        return True

    def send_notif(self, remote: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(remote, msg)
        except Exception as exc:
            raise PeerUnavailable(f"NIXL notification to {remote} failed: {exc}") from exc

    def poll_notifs(self) -> dict[str, list[bytes]]:
        try:
            return self.agent.get_new_notifs()
        except Exception as exc:
            log.warning("get_new_notifs failed: %s", exc)
            return {}

    # -- bookkeeping -------------------------------------------------------------------------------
    @property
    def num_remotes(self) -> int:
        return len(self._remotes)

    @property
    def num_xfers(self) -> int:
        return len(self._xfers)

    @property
    def num_remote_dlists(self) -> int:
        return len(self._remote_dlists)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in list(self._xfers):
            self.release(handle)
        for name in list(self._remotes):
            self._remotes[name] = 1
            self.remove_remote(name)
        if self._local_dlist is not None:
            self._release_dlist(self._local_dlist)
            self._local_dlist = None
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as exc:
            raise TransferError(f"NIXL deregistration failed: {exc}") from exc
