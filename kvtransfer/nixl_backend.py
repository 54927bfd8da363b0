"""The NIXL side of a transport: one agent per process, the whole KV tensor registered once.

Lifecycle::

    NixlAgent(name, memory)            import nixl (nixl_cu12 wheel, or the `nixl` meta-package's nixl._api),
                                       create the agent with the UCX backend, register the KV tensor
                                       (DRAM on CPU, VRAM on GPU) -- once, for the transport's lifetime
    info()                             what the receiver sends in HELLO_OK: agent metadata (base64),
                                       base address, length, device id, memory type
    add_remote(info) / remove_remote   sender side; refcounted per remote agent (one per cached peer)
    post_write(...)                    one-sided WRITE of coalesced (local, remote, length) regions,
                                       optionally carrying a notification
    state(xfer) / release(xfer)        poll DONE / PROC / ERR; release cancels what is still in flight
    send_notif / poll_notifs           completion and probe notifications (small JSON, see protocol.py)
    close()                            release every handle, forget remote agents, deregister memory

All methods are non-blocking C calls made from the transport's event loop thread; the UCX progress
thread inside the agent moves the bytes.
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
    for modname in ("nixl_cu12", "nixl._api"):
        try:
            mod = __import__(modname, fromlist=["nixl_agent", "nixl_agent_config"])
            return mod.nixl_agent, mod.nixl_agent_config, modname
        except Exception as exc:  # ImportError, or a broken native library (OSError)
            errors.append(f"{modname}: {type(exc).__name__}: {exc}")
    raise BackendUnavailable("NIXL is not importable (" + "; ".join(errors) + ")")


class NixlAgent:
    def __init__(self, name: str, memory: KVMemory, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = False) -> None:
        agent_cls, config_cls, self.module = import_nixl()
        self.name = name
        self.memory = memory
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
        self._closed = False
        log.info("NIXL agent %s (%s, UCX_TLS=%s) registered %d bytes of %s", name, self.module,
                 os.environ.get("UCX_TLS", "<default>"), memory.nbytes, self.mem_type)

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
        return name

    def remove_remote(self, name: str) -> None:
        count = self._remotes.get(name, 0) - 1
        if count > 0:
            self._remotes[name] = count
            return
        self._remotes.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # already gone (peer died): nothing left to free
            log.debug("remove_remote_agent(%s): %s", name, exc)

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
        self._xfers.add(handle)
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:
            self.release(handle)
            raise PeerUnavailable(f"NIXL WRITE to {remote} failed to post: {exc}") from exc
        if state == "ERR":
            self.release(handle)
            raise PeerUnavailable(f"NIXL WRITE to {remote} failed to post (ERR)")
        return handle, state

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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in list(self._xfers):
            self.release(handle)
        for name in list(self._remotes):
            self._remotes[name] = 1
            self.remove_remote(name)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as exc:
            raise TransferError(f"NIXL deregistration failed: {exc}") from exc
