"""Sending side: one cached connection per remote endpoint (side channel + TCP data), with its handshake.

Lifecycle::

    connect()      TCP connect (connect_timeout_s), TCP_NODELAY, then HELLO -> HELLO_OK / ERROR:
                   protocol version and KV layout hash must match (mismatch -> LayoutMismatch naming
                   both sides' values). For NIXL the reply carries the receiver's agent metadata and
                   registered region; we load it and prove the path end to end by sending a NIXL
                   notification whose nonce the receiver must report back (PROBE/PROBE_OK). If any of
                   that fails, "auto" falls back to TCP on the same connection and logs why.
    send_frame()   frames are written whole under a lock (sendmsg scatter-gather straight from the
                   source blocks); frames of concurrent transfers interleave at frame granularity
                   HELLO / HELLO_OK also carry each side's capabilities ("caps", protocol.CAPS): frame
                   types newer than version 1's set (WROTE) go only to a receiver that advertised them
    reader task    routes BEGIN_OK / DONE / ERROR / ABORT for a request id to its SendHandle
    dead()         EOF, reset or a poisoned stream (a frame cut short): every handle on it fails with
                   PeerUnavailable, the peer leaves the cache, its NIXL remote agent is forgotten

Peers are reused by every transfer to the same endpoint (host, port, instance).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import select
import socket

from .errors import (
    BackendUnavailable,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    TransferError,
    error_from_wire,
)
from .protocol import (
    CAPS,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    Msg,
    decode_header,
    decode_meta,
    encode,
    meta_caps,
    notif_message,
)

log = logging.getLogger("kvtransfer.tx")
_IOV_MAX = 512


def _advance(views: list[memoryview], i: int, sent: int) -> int:
    while sent:
        head = views[i]
        if sent >= len(head):
            sent -= len(head)
            i += 1
        else:
            views[i] = head[sent:]
            sent = 0
    return i


def _sendmsg_blocking(sock: socket.socket, views: list[memoryview], i: int, stop: list[bool]) -> None:
    """Finish a frame from a worker thread: sendmsg, and poll() for room when the socket buffer is full.
    Both release the GIL, so a large payload costs the event loop nothing while it drains."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i:i + _IOV_MAX])
        except (BlockingIOError, InterruptedError):
            for _fd, ev in poller.poll(100):
                if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    raise ConnectionResetError("socket closed while sending") from None
            if stop[0]:
                raise ConnectionAbortedError("connection closed locally while sending") from None
            continue
        i = _advance(views, i, sent)


async def sendmsg_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, bufs: list, pool=None,
                      stop: list[bool] | None = None) -> None:
    """Write every buffer with scatter-gather sendmsg, never copying them (the loop's own sock_sendall
    would, for what does not fit in the socket buffer at once). What does not go out at once -- a large
    payload -- is finished by a worker thread instead of one event-loop wake-up per socket-buffer fill."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    try:
        i = _advance(views, 0, sock.sendmsg(views[:_IOV_MAX]))
    except (BlockingIOError, InterruptedError):
        i = 0
    if i < len(views):
        await loop.run_in_executor(pool, _sendmsg_blocking, sock, views, i, stop or [False])


class Peer:
    def __init__(self, transport, endpoint: dict) -> None:
        self.t = transport
        self.endpoint = endpoint
        self.key = (endpoint["host"], endpoint["port"], endpoint["instance"])
        self.name = f"{endpoint['host']}:{endpoint['port']}"
        self.loop = transport.loop
        self.sock: socket.socket | None = None
        self.backend = "tcp"
        self.num_blocks = int(endpoint["num_blocks"])
        self.remote: dict | None = None  # receiver's NIXL info from HELLO_OK
        self.remote_agent: str | None = None
        self.caps: frozenset[str] = frozenset()  # the receiver's (HELLO_OK "caps"; none from older peers)
        self.handles: dict[str, object] = {}
        self.closed = False
        self._lock = asyncio.Lock()
        self._waiters: dict[tuple, asyncio.Future] = {}
        self._stop = [False]  # tells a send thread to give up
        self._reader: asyncio.Task | None = None

    # -- setup -------------------------------------------------------------------------------------
    async def connect(self) -> None:
        cfg = self.t.config
        host, port = self.endpoint["host"], int(self.endpoint["port"])
        try:
            infos = await self.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            self.sock = sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cfg.socket_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.socket_buffer_bytes)
            await asyncio.wait_for(self.loop.sock_connect(sock, addr), cfg.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            self.close()
            raise PeerUnavailable(f"cannot connect to KV receiver {self.name}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        self._reader = self.loop.create_task(self._read_loop(), name=f"kvtransfer-peer-{self.name}")
        try:
            await asyncio.wait_for(self._handshake(), cfg.handshake_timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise PeerUnavailable(f"handshake with KV receiver {self.name} timed out "
                                  f"after {cfg.handshake_timeout_s}s") from None
        except BaseException:
            self.close()
            raise

    async def _handshake(self) -> None:
        layout = self.t.layout
        want_nixl = self.t.nixl is not None and "nixl" in self.endpoint.get("backends", ())
        reply = await self._hello("nixl" if want_nixl else "tcp")
        self.caps = meta_caps(reply)
        self.num_blocks = int(reply["num_blocks"])
        if reply.get("layout_hash") != layout.compat_hash():
            raise LayoutMismatch(f"KV layout mismatch: receiver {self.name} hash {reply.get('layout_hash')} "
                                 f"vs sender hash {layout.compat_hash()} ({layout.describe()})")
        if not want_nixl:
            self.backend = "tcp"
            if self.t.kind == "auto":
                why = ("NIXL unavailable here: " + self.t.nixl_error) if self.t.nixl is None \
                    else "receiver offers no NIXL"
                log.info("kvtransfer: peer %s uses TCP (%s)", self.name, why)
            return
        try:
            await self._nixl_setup(reply)
            self.backend = "nixl"
            log.info("kvtransfer: peer %s uses NIXL (agent %s, %s)", self.name, self.remote_agent,
                     self.remote["mem"])
        except (TransferError, asyncio.TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if self.remote_agent is not None:
                self.t.nixl.remove_remote(self.remote_agent)
                self.remote_agent = None
            if self.t.kind != "auto" or "tcp" not in self.endpoint.get("backends", ()):
                raise BackendUnavailable(f"NIXL handshake with {self.name} failed: {why}") from exc
            log.warning("kvtransfer: peer %s: NIXL handshake failed (%s); falling back to TCP",
                        self.name, why)
            await self._hello("tcp")
            self.backend = "tcp"

    async def _hello(self, want: str) -> dict:
        layout = self.t.layout
        fut = self._waiter(("hello",))
        await self.send_frame(Msg.HELLO, {"version": PROTOCOL_VERSION, "layout_hash": layout.compat_hash(),
                                          "layout_desc": layout.describe(), "want": want,
                                          "caps": list(CAPS),
                                          "agent": self.t.nixl.name if self.t.nixl else None})
        return await fut

    async def _nixl_setup(self, reply: dict) -> None:
        info = reply.get("nixl")
        if not isinstance(info, dict):
            raise BackendUnavailable("receiver sent no NIXL metadata")
        if info.get("nbytes") != self.num_blocks * self.t.layout.num_layers * self.t.layout.block_bytes:
            raise BackendUnavailable(f"receiver's registered region ({info.get('nbytes')} bytes) does not "
                                     f"match its {self.num_blocks} blocks")
        self.remote = info
        self.remote_agent = self.t.nixl.add_remote(info)
        nonce = secrets.token_hex(8)
        fut = self._waiter(("probe", nonce))
        # The notification may not go out before UCX has wired up; retry briefly until it is accepted.
        for attempt in range(50):
            try:
                self.t.nixl.send_notif(self.remote_agent, notif_message("probe", nonce=nonce))
                break
            except PeerUnavailable:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.02)
        await self.send_frame(Msg.PROBE, {"nonce": nonce})
        # Half the handshake budget, so that a silent NIXL path still leaves time to fall back to TCP.
        # Meanwhile our own agent must make progress too (UCX wire-up replies): hold our poller busy.
        notifs = self.t.receiver.notifs
        notifs.hold()
        try:
            await asyncio.wait_for(fut, self.t.config.handshake_timeout_s / 2)
        finally:
            notifs.unhold()

    # -- I/O ---------------------------------------------------------------------------------------
    def _waiter(self, key: tuple) -> asyncio.Future:
        fut = self._waiters[key] = self.loop.create_future()
        return fut

    async def send_frame(self, msg: Msg, meta: dict, payload: list | None = None,
                         payload_len: int = 0) -> None:
        await self.send_frames([(msg, meta, payload, payload_len)])

    async def send_frames(self, frames: list[tuple[Msg, dict, list | None, int]]) -> None:
        """Write whole frames, several per sendmsg while their payload stays within max_frame_bytes (a
        small one-shot transfer is one write: BEGIN + DATA + END). Frames of concurrent transfers
        interleave between writes. A write interrupted halfway poisons the stream: the peer is closed."""
        limit = self.t.config.max_frame_bytes
        batch: list = []
        size = 0
        for msg, meta, payload, payload_len in frames:
            if batch and size + payload_len > limit:
                await self._write(batch)
                batch, size = [], 0
            batch.append(encode(msg, meta, payload_len))
            batch.extend(payload or ())
            size += payload_len
        if batch:
            await self._write(batch)

    async def _write(self, bufs: list) -> None:
        if self.closed:
            raise PeerUnavailable(f"connection to KV receiver {self.name} is closed")
        async with self._lock:
            if self.closed:
                raise PeerUnavailable(f"connection to KV receiver {self.name} is closed")
            # Small frames (BEGIN, WROTE, ...) usually fit in the socket buffer: written here, at once,
            # without a task and an event-loop turn (nothing to cut short, so no cancellation concern).
            views = [memoryview(b).cast("B") for b in bufs if len(b)]
            try:
                i = _advance(views, 0, self.sock.sendmsg(views[:_IOV_MAX]))
            except (BlockingIOError, InterruptedError):
                i = 0
            except OSError as exc:
                self.dead(PeerUnavailable(f"KV receiver {self.name} connection lost: {exc}"))
                raise PeerUnavailable(f"KV receiver {self.name} connection lost while sending: "
                                      f"{exc}") from exc
            if i == len(views):
                return
            write = sendmsg_all(self.loop, self.sock, views[i:], self.t.send_pool, self._stop)
            task = self.loop.create_task(write)
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                # Let the write finish (the stream must stay in sync) unless it is stuck.
                try:
                    await asyncio.wait_for(task, 2.0)
                except BaseException:
                    self.dead(PeerUnavailable(f"frame to {self.name} cut short"))
                raise
            except OSError as exc:
                self.dead(PeerUnavailable(f"KV receiver {self.name} connection lost: {exc}"))
                raise PeerUnavailable(f"KV receiver {self.name} connection lost while sending: "
                                      f"{exc}") from exc

    async def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, pos = memoryview(buf), 0
        while pos < n:
            got = await self.loop.sock_recv_into(self.sock, view[pos:])
            if not got:
                raise PeerUnavailable(f"KV receiver {self.name} closed the connection")
            pos += got
        return buf

    async def _read_loop(self) -> None:
        try:
            while True:
                msg, _flags, meta_len, _plen = decode_header(await self._recv_exact(HEADER_SIZE))
                self._dispatch(msg, decode_meta(await self._recv_exact(meta_len)))
        except asyncio.CancelledError:
            raise
        except (OSError, TransferError) as exc:
            if not isinstance(exc, TransferError):
                exc = PeerUnavailable(f"KV receiver {self.name} connection lost: {exc}")
            self.dead(exc)

    def _dispatch(self, msg: Msg, meta: dict) -> None:
        rid = meta.get("rid")
        if msg in (Msg.HELLO_OK, Msg.PROBE_OK) or (msg == Msg.ERROR and rid is None):
            key = ("probe", meta.get("nonce")) if msg == Msg.PROBE_OK else ("hello",)
            fut = self._waiters.pop(key, None) or self._waiters.pop(("hello",), None)
            if fut is None:
                if msg == Msg.ERROR:
                    self.dead(error_from_wire(meta, f"KV receiver {self.name}: "))
                return
            if fut.done():
                return
            if msg == Msg.ERROR:
                fut.set_exception(error_from_wire(meta, f"KV receiver {self.name} refused: "))
            else:
                fut.set_result(meta)
            return
        if not isinstance(rid, str):
            raise ProtocolError(f"{msg.name} frame without a request id")
        handle = self.handles.get(rid)
        if msg == Msg.ABORT:
            if handle is None:
                self.loop.create_task(self._ack_abort(rid))
            else:
                handle._remote_abort(str(meta.get("reason", "")))
        elif handle is None:
            return  # a late reply for a transfer that already ended
        elif msg == Msg.BEGIN_OK:
            handle._on_begin_ok()
        elif msg == Msg.DONE:
            handle._on_done()
        elif msg == Msg.ERROR:
            handle._on_error(error_from_wire(meta, f"KV receiver {self.name} rejected {rid!r}: "))

    async def _ack_abort(self, rid: str) -> None:
        try:
            await self.send_frame(Msg.ABORT_ACK, {"rid": rid})
        except TransferError:
            pass

    # -- teardown ----------------------------------------------------------------------------------
    def dead(self, exc: TransferError) -> None:
        if self.closed:
            return
        log.warning("kvtransfer: peer %s lost: %s", self.name, exc)
        self.close(exc)

    def close(self, exc: TransferError | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop[0] = True
        exc = exc or PeerUnavailable(f"connection to KV receiver {self.name} closed")
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.add_done_callback(lambda f: f.exception())
        self._waiters.clear()
        for handle in list(self.handles.values()):
            handle._on_error(exc)
        sock, self.sock = self.sock, None
        reader = self._reader
        if reader is not None and not reader.done() and reader is not asyncio.current_task():
            # Close the socket only once the reader has unregistered it: its fd number may be reused.
            self._reader.cancel()
            if sock is not None:
                self._reader.add_done_callback(lambda _t: sock.close())
        elif sock is not None:
            sock.close()
        if self.remote_agent is not None and self.t.nixl is not None:
            self.t.nixl.remove_remote(self.remote_agent)
            self.remote_agent = None
        self.t._forget_peer(self)
