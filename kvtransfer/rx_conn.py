"""One accepted side-channel connection on the receiving side: frame parsing, zero-copy receive.

An ``asyncio.BufferedProtocol``: the event loop asks ``get_buffer()`` where the next bytes should go
and the kernel copies them there with ``recv_into``. While a DATA frame's payload is arriving, that
buffer is a memoryview of the destination blocks themselves (or of a staging buffer for device
memory), so KV bytes are copied exactly once, socket -> KV cache. Header and metadata are parsed and
validated by the Receiver *before* the payload's first byte is accepted; an invalid frame's payload is
read into a scratch buffer and dropped, so the stream stays in sync and other requests on the same
connection carry on.

TLS in helper processes (tls_relay.py, the default): the socket is a relay's plaintext end, and
nothing here differs from plaintext. TLS in this process (``TransportConfig.tls_procs`` 0, a
``TlsChannel``, tls.py): the loop receives ciphertext, runs the handshake (certificate of the
cluster CA required, within handshake_timeout_s) and decrypts headers, metadata and small payloads into
the same targets; a large payload is read and decrypted by a worker thread, straight into its targets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time

from .errors import ProtocolError, TransferError, error_to_wire
from .iovec import IOV_MAX, advance, whole_frame_io
from .protocol import HEADER_SIZE, Msg, decode_header, decode_meta, encode
from .tls import TlsChannel, tls_recv_all

log = logging.getLogger("kvtransfer.rx")
_SCRATCH = 1 << 20
# Payloads at least this large are received by a worker thread (reading paused on the event loop):
# one readv() per socket-buffer fill, GIL released, instead of one loop iteration per recv.
_THREAD_MIN = 1 << 20
_RAW = 1 << 18  # TLS: ciphertext read per loop callback
_PEEK = 64 << 10  # the most of a next frame's head a receive thread looks at (DATA metadata is ~1 KiB)


def _recv_all(fd: int, views: list[memoryview] | None, stop: list[bool], progress: list[float],
              chain: bool = False, ctx=None, rx=None) -> tuple[int, int, float, float, bytes | None]:
    """Fill views from the connection's socket (fd: a dup the caller owns) in as few calls as the frame
    allows: the socket is blocking for the frame (iovec.whole_frame_io) and each ``recvmsg_into`` waits
    for all its buffers (MSG_WAITALL), so the thread takes the GIL back once per frame (per IOV_MAX
    buffers, per IO_TIMEOUT_S), not once per socket-buffer fill: beside a thread running Python,
    non-blocking reads moved 0.66-0.67 GB/s and these 1.54-1.67 (2.70-3.29 at a 0.5 ms switch
    interval, TransportConfig.gil_switch_interval_s; bench/gil_probe.py). Raises on EOF/reset/stop;
    the socket is non-blocking again on return (the loop reads it next). Returns (calls, bytes, 0.0,
    seconds in all) for IoStats, and with ``chain`` the next frame's header and metadata when they were
    already in the socket (``_next_frame_head``), else None. With a frame context ``ctx`` and its
    receiver ``rx`` (lane staging, TransportConfig.tcp_lane_staging): ``views`` None, the staging buffer
    is allocated here first (``rx.stage_in``) and the payload landed here last (``rx.land``).

    The blocking mode is the event loop's too (one file description): during the frame the loop does not
    read the socket (reading is paused), and its writes are small replies into a send buffer the
    sender keeps drained."""
    start = time.monotonic()
    sock = socket.socket(fileno=fd)
    try:
        whole_frame_io(sock)
        views = list(views if views is not None else rx.stage_in(ctx))
        i = calls = nbytes = 0
        while i < len(views):
            try:
                got = sock.recvmsg_into(views[i:i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
            except (BlockingIOError, InterruptedError):  # IO_TIMEOUT_S with nothing received
                got = -1
            if got == 0:
                raise ConnectionResetError("sender closed the connection mid-frame")
            if got > 0:
                progress[0] = time.monotonic()
                calls, nbytes = calls + 1, nbytes + got
                i = advance(views, i, got)
            if stop[0] and i < len(views):
                raise ConnectionAbortedError("connection closed locally while receiving")
        if rx is not None:
            rx.land(ctx)
        head = _next_frame_head(sock) if chain else None
    finally:
        sock.setblocking(False)
        sock.detach()
    return calls, nbytes, 0.0, time.monotonic() - start, head


def _next_frame_head(sock: socket.socket) -> bytes | None:
    """The next frame's header and metadata, taken off the socket only when both are wholly there now
    (never waits: ``MSG_PEEK | MSG_DONTWAIT`` first), else None and nothing consumed.

    Why (TransportConfig.tcp_rx_chain): in a serving decode worker the event loop also runs every token
    stream, and each frame taken back to the loop cost it three turns before the next payload was on a
    thread (thread done, header, metadata), each behind the loop's other callbacks: the connection sat
    idle ~12 ms per 16 MiB frame at 10 req/s (docs/kvtransfer.md). With the head read here, the loop's
    one turn for the finished frame also dispatches the next. Anything odd (a short or malformed header)
    is left on the socket for the loop's parser, which reports it as before."""
    try:
        peek = sock.recv(_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        if len(peek) < HEADER_SIZE:
            return None
        _msg, _flags, meta_len, _payload = decode_header(peek[:HEADER_SIZE])
    except (BlockingIOError, InterruptedError, ProtocolError):
        return None
    want = HEADER_SIZE + meta_len
    if len(peek) < want:
        return None
    buf = bytearray(want)
    got = sock.recv_into(buf, want, socket.MSG_DONTWAIT)  # already queued: all of it comes
    if got != want:  # cannot happen with one reader; fail the connection rather than lose sync
        raise ConnectionResetError(f"read {got} of a {want}-byte frame head the socket had queued")
    return bytes(buf)


class RxConnection(asyncio.BufferedProtocol):
    def __init__(self, receiver, tls: ssl.SSLContext | None = None, peer: str | None = None) -> None:
        self.rx = receiver
        self._tls = tls
        self.chan: TlsChannel | None = None  # with TLS: made in connection_made, handshake on the loop
        self._raw: memoryview | None = None  # TLS: where the loop receives ciphertext
        self._handshake_timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = peer or "?"  # given when the socket is a TLS relay's plaintext end (tls_relay.py)
        self.closed = False
        self.abort_acks: dict[str, asyncio.Future] = {}
        self.nixl_agent: str | None = None  # the sender's NIXL agent, as named in its HELLO
        self.sender: str | None = None  # the sender's transport instance, as named in its HELLO
        # Last instant bytes arrived (the readv thread updates it too): a transfer past its deadline is
        # failed only once its connection stopped moving (Receiver._on_deadline).
        self.progress = [time.monotonic()]
        self._hdr = bytearray(HEADER_SIZE)
        self._state = "header"
        self._pos = 0
        self._meta = bytearray()
        self._msg = Msg.HELLO
        self._payload_len = 0
        self._targets: list[memoryview] = []
        self._ti = 0
        self._ctx = None
        self._discard = 0
        self._scratch: memoryview | None = None
        self._fd: int | None = None
        self._stop = [False]
        self._t_meta = 0.0  # trace: when the current DATA frame's payload was dispatched to a thread
        self._t_done = 0.0  # trace: when this connection's previous thread-read frame ended

    # -- asyncio callbacks -------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"{peer[0]}:{peer[1]}"
        if sock is not None:
            # A private dup, so a worker thread never reads a reused fd number after asyncio closes its own.
            self._fd = os.dup(sock.fileno())
        if self._tls is not None:
            self.chan = TlsChannel(self._tls, server_side=True)
            self._raw = memoryview(bytearray(_RAW))
            self._handshake_timer = asyncio.get_running_loop().call_later(
                self.rx.config.handshake_timeout_s, self._handshake_expired)
        if sock is not None:
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.rx.config.socket_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rx.config.socket_buffer_bytes)
        self.rx.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._stop[0] = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        if self._fd is not None and self._state != "thread":
            os.close(self._fd)
            self._fd = None
        self.rx.conns.discard(self)
        if self._state == "payload" and self._ctx is not None:  # read on the loop: no more of it comes
            ctx, self._ctx = self._ctx, None
            self.rx.on_data_dropped(self, ctx)
        for fut in self.abort_acks.values():
            if not fut.done():
                fut.set_result(False)
        self.rx.on_conn_lost(self, exc)

    def get_buffer(self, sizehint: int):
        return self._raw if self.chan is not None else self._target()

    def _target(self) -> memoryview:
        """Where the next plaintext bytes of the current frame go."""
        if self._state == "header":
            return memoryview(self._hdr)[self._pos:]
        if self._state == "meta":
            return memoryview(self._meta)[self._pos:]
        if self._state == "payload":
            return self._targets[self._ti][self._pos:]
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        return self._scratch[:min(_SCRATCH, self._discard)]

    @property
    def last_progress(self) -> float:
        return self.progress[0]

    def buffer_updated(self, nbytes: int) -> None:
        self.progress[0] = time.monotonic()
        if self.chan is None:
            self._guarded(self._advance, nbytes)
        else:
            self._guarded(self._tls_received, nbytes)

    def _guarded(self, step, *args) -> None:
        try:
            step(*args)
        except ProtocolError as exc:
            log.warning("kvtransfer: closing connection from %s: %s", self.peer, exc)
            self.send(Msg.ERROR, error_to_wire(exc))
            self.close()
        except (ssl.SSLError, ConnectionResetError) as exc:
            # A peer without a certificate of the cluster CA ends here, during the handshake.
            log.info("kvtransfer: TLS connection from %s closed: %s", self.peer, exc)
            self.close()

    # -- TLS ---------------------------------------------------------------------------------------
    def _tls_received(self, nbytes: int) -> None:
        data = self._raw[:nbytes]
        if not self.chan.established:
            out = self.chan.handshake(data)
            if out:
                self.transport.write(out)
            if not self.chan.established:
                return
            self._handshake_timer.cancel()
        else:
            self.chan.feed(data)
        self._pump()

    def _pump(self) -> None:
        """Decrypt what the channel holds into the current frame, on the loop, until it holds no more or
        a large payload went to a thread (which carries on from the same channel)."""
        while self._state != "thread" and not self.closed:
            got = self.chan.decrypt_into(self._target())
            if not got:
                return
            self._advance(got)

    def _handshake_expired(self) -> None:
        if not self.chan.established:
            log.info("kvtransfer: TLS handshake from %s timed out", self.peer)
            self.close()

    def eof_received(self):
        return False  # close our side too

    # -- parsing -----------------------------------------------------------------------------------
    def _advance(self, nbytes: int) -> None:
        self._pos += nbytes
        if self._state == "header":
            if self._pos < HEADER_SIZE:
                return
            self._msg, _flags, meta_len, self._payload_len = decode_header(self._hdr)
            if meta_len < 2:
                raise ProtocolError("frame without metadata")
            self._meta = bytearray(meta_len)
            self._state, self._pos = "meta", 0
        elif self._state == "meta":
            if self._pos < len(self._meta):
                return
            self._on_meta(decode_meta(self._meta))
        elif self._state == "payload":
            if self._pos < len(self._targets[self._ti]):
                return
            self._ti, self._pos = self._ti + 1, 0
            if self._ti == len(self._targets):
                ctx, self._ctx, self._targets = self._ctx, None, []
                self._reset()
                self.rx.on_data_complete(self, ctx)
        else:  # discard
            self._discard -= nbytes
            self._pos = 0
            if self._discard == 0:
                self._reset()

    def _reset(self) -> None:
        self._state, self._pos = "header", 0

    def _on_meta(self, meta: dict) -> None:
        if self._msg != Msg.DATA:
            self._reset()
            self.rx.on_control(self, self._msg, meta)
            return
        threaded = self._payload_len >= _THREAD_MIN and self._fd is not None
        try:
            # targets None: the receive thread allocates them (lane staging, rx_tcp.on_data)
            self._ctx, self._targets = self.rx.on_data(self, meta, self._payload_len,
                                                       threaded and self.chan is None)
        except TransferError as exc:
            # Rejected before a single payload byte lands in KV memory: drop the payload.
            self._discard = self._payload_len
            self._state, self._pos = ("discard", 0) if self._discard else ("header", 0)
            rid = meta.get("rid") if isinstance(meta.get("rid"), str) else None
            if rid is not None:
                self.send(Msg.ERROR, {"rid": rid, **error_to_wire(exc)})
            return
        deferred = self._targets is None
        self._ti, self._pos = 0, 0
        self._state = "payload" if self._targets or deferred else "header"
        if threaded:
            self._state = "thread"
            self._t_meta = time.monotonic()
            self.transport.pause_reading()
            loop = asyncio.get_running_loop()
            if self.chan is not None:
                fut = loop.run_in_executor(self.rx.recv_pool, tls_recv_all, self._fd, self.chan,
                                           self._targets, self._stop, self.progress)
            else:
                fut = loop.run_in_executor(self.rx.recv_pool, _recv_all, self._fd, self._targets, self._stop,
                                           self.progress, self.rx.config.tcp_rx_chain,
                                           *((self._ctx, self.rx) if deferred else ()))
            fut.add_done_callback(self._thread_done)
        if not self._targets and not deferred:
            ctx, self._ctx = self._ctx, None
            self.rx.on_data_complete(self, ctx)

    def _thread_done(self, fut: asyncio.Future) -> None:
        exc = fut.exception()
        ctx, self._ctx, self._targets = self._ctx, None, []
        self._reset()
        if self.closed:  # connection_lost ran meanwhile and left the fd to us
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self.rx.on_data_dropped(self, ctx)
            return
        if exc is not None:
            log.warning("kvtransfer: connection from %s broke mid-frame: %s", self.peer, exc)
            self.close()
            self.rx.on_data_dropped(self, ctx)
            return
        io = fut.result()
        self.rx.io_rx.add(*io[:4])
        if self.rx.config.trace:
            self._trace_frame(ctx.exp, io)
        self.rx.on_data_complete(self, ctx)
        if self.chan is not None:
            self.transport.resume_reading()
            self._guarded(self._pump)  # the thread may have decrypted past its frame: the next one is here
            return
        if io[4] is not None and not self.closed:
            self._guarded(self._take_head, io[4])  # may put the next payload on a thread at once
        if self._state != "thread" and not self.closed:
            self.transport.resume_reading()

    def _take_head(self, head: bytes) -> None:
        """Parse a frame head a receive thread read past its payload (``_next_frame_head``) as if the loop
        had received it: header, then metadata, then the frame's handler."""
        self._hdr[:] = head[:HEADER_SIZE]
        self._pos = HEADER_SIZE
        self._advance(0)  # header -> "meta" with its buffer sized
        self._meta[:] = head[HEADER_SIZE:]
        self._pos = len(self._meta)
        self._advance(0)  # -> _on_meta

    def _trace_frame(self, exp, io: tuple) -> None:
        """Sums for the ``kvtrace rx-frames`` line (trace.py): this frame's time from dispatch to done,
        its thread's seconds (and of them in poll: TLS on this thread only, trace.py), and the gap since
        this connection's previous frame ended, when that was after this transfer was expected (the
        sender's next frame not there yet, or the hops in between)."""
        now = time.monotonic()
        f = exp.frame_stats
        f["frames"] = f.get("frames", 0) + 1
        f["frame_s"] = f.get("frame_s", 0.0) + now - self._t_meta
        f["thread_s"] = f.get("thread_s", 0.0) + io[3]
        f["poll_s"] = f.get("poll_s", 0.0) + io[2]
        if io[4] is not None:  # the thread took the next frame's head too (tcp_rx_chain)
            f["chained"] = f.get("chained", 0) + 1
        if self._t_done >= exp.started:  # idle time before this transfer began is not a gap of it
            f["gap_s"] = f.get("gap_s", 0.0) + self._t_meta - self._t_done
        self._t_done = now

    # -- replies -----------------------------------------------------------------------------------
    def send(self, msg: Msg, meta: dict) -> None:
        if self.transport is not None and not self.transport.is_closing():
            data = encode(msg, meta)
            if self.chan is not None:
                if not self.chan.established:
                    return
                data = b"".join(self.chan.encrypt([data]))  # a small control frame
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
