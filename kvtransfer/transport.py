"""KVTransport: the object a prefill or decode service holds, and make_transport() to build one.

Lifecycle (both roles use the same object; one per process, owning nothing but a view of the engine's
KV tensor)::

    t = make_transport("auto", layout, engine.kv_cache)   # NIXL agent created + tensor registered, or
                                                          # TCP only (logged, with the reason)
    await t.start()                                       # side-channel listener on config.listen_*
    ep = t.endpoint()                                     # JSON-able dict for the other side

    decode (receiver)                                     prefill (sender)
    exp = t.expect(rid, dst_blocks, deadline)             h = t.start_send(rid, ep, src_blocks, dst_blocks)
    ... hand ep + dst_blocks to the prefill side ...      await h.wait()  (or h.done() / h.abort())
    await exp.wait()   -> KV complete, commit_prefilled   streaming: start_send(..., layers=range(0, k));
    t.release(rid) / await t.abort(rid)                   h.push_layers(range(k, n)); h.finish()

    await t.close()                                       # fails what is pending, deregisters, closes

Every method must be called from the event loop that ran start(). Errors are TransferError subclasses
whose ``code`` names the gRPC status to return.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch

from engine.kv_layout import KVLayout

from .blocks import validate_block_ids, validate_layers
from .config import TransportConfig
from .errors import BackendUnavailable, InvalidTransfer, LayoutMismatch, TransferError
from .iostats import IoStats
from .memory import KVMemory
from .peer import Peer
from .protocol import PROTOCOL_VERSION
from .receiver import Expectation, Receiver
from .rx_conn import RxConnection
from .rx_nixl import fine_timer_slack
from .sender import SendHandle
from .tls import server_context
from .tls_relay import TlsRelays

log = logging.getLogger("kvtransfer")


@runtime_checkable
class Transport(Protocol):
    """What the services code against (KVTransport implements it)."""

    async def start(self) -> Transport: ...
    def endpoint(self) -> dict: ...
    def expect(self, request_id: str, dst_block_ids, deadline: float | None = None, *,
               timeout: float | None = None) -> Expectation: ...
    async def wait_complete(self, request_id: str) -> dict: ...
    async def abort(self, request_id: str, reason: str = "aborted") -> bool: ...
    def release(self, request_id: str) -> None: ...
    def start_send(self, request_id: str, endpoint: dict, src_block_ids, dst_block_ids, layers=None, *,
                   timeout: float | None = None) -> SendHandle: ...
    def stats(self) -> dict: ...
    async def close(self) -> None: ...


class KVTransport:
    def __init__(self, layout: KVLayout, kv_tensor: torch.Tensor, config: TransportConfig) -> None:
        self.layout = layout
        self.config = config
        self.kind = config.kind
        self.memory = KVMemory(kv_tensor, layout, force_staging=config.force_staging,
                               blocking_sync=config.staging_blocking_sync, gather=config.staging_gather)
        self.instance = uuid.uuid4().hex
        self.nixl = None
        self.nixl_error = ""
        if config.kind != "tcp":
            from .nixl_backend import NixlAgent  # noqa: PLC0415  (keeps TCP-only users off the import)

            name = config.agent_name or f"pdkv-{socket.gethostname()}-{self.instance[:12]}"
            try:
                self.nixl = NixlAgent(name, self.memory, config.nixl_backends, config.nixl_progress_thread,
                                      prepped=config.nixl_prepped, ucx_env=config.ucx_env)
            except BackendUnavailable as exc:
                if config.kind == "nixl":
                    raise
                self.nixl_error = str(exc)
                log.warning("kvtransfer: NIXL unavailable, using TCP only: %s", exc)
        if config.kind == "tcp":
            self.backends: tuple[str, ...] = ("tcp",)
        elif config.kind == "nixl":
            self.backends = ("nixl",)
        else:
            self.backends = ("nixl", "tcp") if self.nixl is not None else ("tcp",)
        log.info("kvtransfer: transport kind=%s offers %s (%s)", config.kind, list(self.backends),
                 layout.describe())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.receiver: Receiver | None = None
        self._server: asyncio.Server | None = None
        self._port = 0
        self._peers: dict[tuple, Peer] = {}
        self._connecting: dict[tuple, asyncio.Task] = {}
        self._sends: dict[str, SendHandle] = {}
        self._closed = False
        # Dedicated threads receiving large payloads (a pool of their own: never starved by the
        # application's default executor). One per connection of a peer and as many again for a second
        # peer; beyond that a frame waits for a thread (its connection's reading pauses meanwhile,
        # nothing else does). Sending: each lane has a writer thread of its own (lane.py).
        threads = max(4, 2 * config.tcp_connections)
        self.recv_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtransfer-recv")
        self.io_tx = IoStats()  # what the lanes' writer threads did (counters())
        # TLS in helper processes (tls_relay.py); None: no TLS, or TLS on this process's I/O threads.
        self.relays = TlsRelays(config, config.tls_procs) if config.tls and config.tls_procs else None
        self._listeners: list[socket.socket] = []  # with relays: our accepting copies of the listen sockets
        self._accepting: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> KVTransport:
        self.loop = asyncio.get_running_loop()
        lower_gil_switch_interval(self.config.gil_switch_interval_s)
        if self.config.fine_timer_slack and self.nixl is not None:
            fine_timer_slack()  # this thread's fast-wait naps (sender.py) last what they ask for
        self.receiver = Receiver(layout=self.layout, memory=self.memory, config=self.config, nixl=self.nixl,
                                 backends=self.backends, loop=self.loop)
        self.receiver.recv_pool = self.recv_pool
        tls = server_context(self.config) if self.relays is None else None  # None: plaintext (or relayed)
        self._server = await self.loop.create_server(
            lambda: RxConnection(self.receiver, tls), self.config.listen_host, self.config.listen_port,
            reuse_address=True, start_serving=self.relays is None)
        self._port = self._server.sockets[0].getsockname()[1]
        if self.relays is not None:
            # asyncio binds the listener as it always does but never accepts on it: every connection is
            # accepted here and handed to a TLS relay first; the connection served is its plaintext end.
            self.relays.start()
            for ts in self._server.sockets:
                sock = socket.socket(fileno=os.dup(ts.fileno()))
                sock.setblocking(False)
                sock.listen(100)  # (asyncio listens only when it serves)
                self._listeners.append(sock)
                self._accepting.append(self.loop.create_task(self._accept(sock), name="kvtransfer-accept"))
        return self

    async def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, addr = await self.loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # out of file descriptors, say: the listener itself stays
                log.warning("kvtransfer: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "?"
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                plain = self.relays.attach(conn, server_side=True)
                await self.loop.connect_accepted_socket(
                    lambda p=peer: RxConnection(self.receiver, None, peer=p), sock=plain)
            except OSError as exc:
                log.warning("kvtransfer: cannot hand the connection from %s to a TLS relay: %s", peer, exc)

    async def __aenter__(self) -> KVTransport:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in list(self._sends.values()):
            await handle.abort("transport closing")
        for task in self._connecting.values():
            task.cancel()
        for peer in list(self._peers.values()):
            peer.close()
        if self.receiver is not None:
            self.receiver.close()
        for task in self._accepting:
            task.cancel()
        for sock in self._listeners:
            sock.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await asyncio.sleep(0)  # let cancelled readers unregister their sockets
        # I/O threads notice the closed connections within ~100 ms (their poll timeout).
        if self.loop is not None:
            await self.loop.run_in_executor(None, self.recv_pool.shutdown)
        else:
            self.recv_pool.shutdown(wait=False)
        if self.relays is not None:
            if self.loop is not None:
                await self.loop.run_in_executor(None, self.relays.close)
            else:
                self.relays.close()
        if self.nixl is not None:
            self.nixl.close()

    # -- receiver side -----------------------------------------------------------------------------
    def endpoint(self) -> dict:
        if self._server is None:
            raise TransferError("endpoint() before start()")
        return {"protocol": "pdkv", "version": PROTOCOL_VERSION, "host": self.config.host_for_endpoint,
                "port": self._port, "instance": self.instance, "backends": list(self.backends),
                "layout": self.layout.to_dict(), "layout_hash": self.layout.compat_hash(),
                "num_blocks": self.memory.num_blocks,
                "nixl_agent": self.nixl.name if self.nixl is not None else None}

    def expect(self, request_id: str, dst_block_ids, deadline: float | None = None, *,
               timeout: float | None = None) -> Expectation:
        """Register the blocks a sender will fill; deadline is a time.monotonic() instant (or timeout= s)."""
        if self.receiver is None or self._closed:
            raise TransferError("transport not started or already closed")
        if (deadline is None) == (timeout is None):
            raise ValueError("expect() needs exactly one of deadline (time.monotonic() instant) or timeout")
        return self.receiver.expect(request_id, dst_block_ids,
                                    deadline if deadline is not None else time.monotonic() + timeout)

    async def wait_complete(self, request_id: str) -> dict:
        exp = self.receiver.expectations.get(request_id)
        if exp is None:
            from .errors import UnknownRequest  # noqa: PLC0415

            raise UnknownRequest(f"request {request_id!r} is not expected (never, or already finished)")
        return await exp.wait()

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort on either side. Receiver: True once no write of it can land any more."""
        handle = self._sends.get(request_id)
        if handle is not None:
            await handle.abort(reason)
        return await self.receiver.abort(request_id, reason)

    def release(self, request_id: str) -> None:
        """Idempotent: forget a request on the receiver side, aborting it if still pending."""
        self.receiver.release(request_id)

    # -- sender side -------------------------------------------------------------------------------
    def start_send(self, request_id: str, endpoint: dict, src_block_ids, dst_block_ids, layers=None, *,
                   timeout: float | None = None) -> SendHandle:
        """Start pushing src blocks into the endpoint's dst blocks; layers=None sends all and finishes."""
        if self._closed or self.loop is None:
            raise TransferError("transport not started or already closed")
        ep = parse_endpoint(endpoint)
        if ep["layout_hash"] != self.layout.compat_hash():
            theirs = _describe(ep.get("layout"))
            raise LayoutMismatch(f"KV layout mismatch: receiver hash {ep['layout_hash']} ({theirs}) vs "
                                 f"sender hash {self.layout.compat_hash()} ({self.layout.describe()})")
        if not set(ep["backends"]) & set(self.backends):
            raise BackendUnavailable(f"no common backend: receiver offers {ep['backends']}, "
                                     f"this side {list(self.backends)}")
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            raise InvalidTransfer("request id must be a non-empty string of <= 256 chars, "
                                  f"got {request_id!r:.80}")
        if request_id in self._sends:
            raise InvalidTransfer(f"request {request_id!r} is already being sent")
        src = validate_block_ids(src_block_ids, self.memory.num_blocks, "source")
        dst = validate_block_ids(dst_block_ids, ep["num_blocks"], "destination")
        if len(src) != len(dst):
            raise InvalidTransfer(f"{len(src)} source blocks but {len(dst)} destination blocks")
        first = validate_layers(layers, self.layout.num_layers)
        handle = SendHandle(self, request_id, ep, src, dst,
                            timeout if timeout is not None else self.config.send_timeout_s)
        self._sends[request_id] = handle
        handle.push_layers(first, final=layers is None)
        return handle

    async def _peer_for(self, endpoint: dict) -> Peer:
        key = (endpoint["host"], endpoint["port"], endpoint["instance"])
        peer = self._peers.get(key)
        if peer is not None and not peer.closed:
            return peer
        task = self._connecting.get(key)
        if task is None:
            task = self._connecting[key] = self.loop.create_task(self._connect(key, endpoint))
            task.add_done_callback(lambda t: self._connect_done(key, t))
        return await asyncio.shield(task)

    def _connect_done(self, key: tuple, task: asyncio.Task) -> None:
        self._connecting.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it already

    async def _connect(self, key: tuple, endpoint: dict) -> Peer:
        peer = Peer(self, endpoint)
        await peer.connect()
        self._peers[key] = peer
        return peer

    def _forget_peer(self, peer: Peer) -> None:
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts that must all be 0 when idle (leak checks), plus peers (cached connections)."""
        rx = self.receiver
        return {"expectations": len(rx.expectations) if rx else 0,
                "unsettled": len(rx.unsettled) if rx else 0,  # failed, not yet told (sender, frames arriving)
                "sends": len(self._sends),
                "peers": len(self._peers),
                "peer_handles": sum(len(p.handles) for p in self._peers.values()),
                "peer_load": sum(lane.load for p in self._peers.values() for lane in p.lanes),
                # bytes of frames queued on the lanes' writer threads (tcp_lane_staging), not written yet
                "peer_queued": sum(lane.queued_bytes for p in self._peers.values() for lane in p.lanes),
                "nixl_xfers": self.nixl.num_xfers if self.nixl else 0,
                "nixl_remote_agents": self.nixl.num_remotes if self.nixl else 0,
                "nixl_remote_dlists": self.nixl.num_remote_dlists if self.nixl else 0,
                "rx_connections": len(rx.conns) if rx else 0}

    def counters(self) -> dict:
        """Cumulative counters (not leak checks): NIXL WRITEs posted and the descriptors they carried; what
        the TCP I/O threads did with large frames, each way (iostats.py); the TLS relay helpers
        (tls_relay.py): alive now, connections handed to them, restarts."""
        n = self.nixl
        rx = self.receiver.io_rx.as_dict() if self.receiver is not None else IoStats().as_dict()
        relays = self.relays
        tls = ({"procs": len(relays.pids()), "handed": relays.handed, "restarts": relays.restarts}
               if relays is not None else {"procs": 0, "handed": 0, "restarts": 0})
        return {"nixl_posted_xfers": n.posted_xfers if n else 0, "nixl_descs": n.posted_descs if n else 0,
                "tcp_tx_io": self.io_tx.as_dict(), "tcp_rx_io": rx, "tls_relays": tls}

    def peer_backend(self, endpoint: dict) -> str | None:
        """Which backend the cached connection to this endpoint uses (None if not connected)."""
        ep = parse_endpoint(endpoint)
        peer = self._peers.get((ep["host"], ep["port"], ep["instance"]))
        return peer.backend if peer is not None else None


def lower_gil_switch_interval(seconds: float) -> None:
    """Lower the process's GIL switch interval to ``seconds`` (TransportConfig.gil_switch_interval_s says
    why); never raise it, and 0 leaves it as it is."""
    if 0 < seconds < sys.getswitchinterval():
        log.info("kvtransfer: GIL switch interval %.1f ms -> %.2f ms (gil_switch_interval_s)",
                 sys.getswitchinterval() * 1e3, seconds * 1e3)
        sys.setswitchinterval(seconds)


def parse_endpoint(endpoint: dict) -> dict:
    """Validate an endpoint dict (as produced by endpoint(), possibly after a JSON round trip)."""
    if not isinstance(endpoint, dict) or endpoint.get("protocol") != "pdkv":
        raise InvalidTransfer("not a kvtransfer endpoint description")
    if endpoint.get("version") != PROTOCOL_VERSION:
        raise LayoutMismatch(f"protocol version mismatch: receiver {endpoint.get('version')!r}, "
                             f"sender {PROTOCOL_VERSION}")
    for key, kind in (("host", str), ("port", int), ("instance", str), ("layout_hash", str),
                      ("num_blocks", int), ("backends", list)):
        if not isinstance(endpoint.get(key), kind):
            raise InvalidTransfer(f"endpoint field {key!r} missing or not a {kind.__name__}")
    return endpoint


def _describe(layout) -> str:
    try:
        return KVLayout.from_dict(layout).describe()
    except (TypeError, ValueError):
        return "?"


def make_transport(kind: str = "auto", layout: KVLayout | None = None,
                   kv_tensor: torch.Tensor | None = None, *, config: TransportConfig | None = None,
                   **overrides) -> KVTransport:
    """Build a (not yet started) transport: kind "auto" | "nixl" | "tcp"; overrides: TransportConfig."""
    if layout is None or kv_tensor is None:
        raise ValueError("make_transport needs the KV layout and the KV tensor")
    base = config.__dict__ if config is not None else {}
    cfg = TransportConfig(**{**base, **overrides, "kind": kind})
    return KVTransport(layout, kv_tensor, cfg)
