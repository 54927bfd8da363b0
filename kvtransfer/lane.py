"""One sender-side connection to a receiver (a ``Peer`` holds one or more): whole frames out, replies in.

Plaintext: frames go out with scatter-gather ``sendmsg`` straight from the source blocks; a small write
is tried at once on the event loop when nothing is queued, a large one (TransportConfig.
inline_write_max_bytes) and whatever did not fit in the socket buffer is written by the lane's own
writer thread, whole frames per call with the GIL released (the socket is blocking, iovec.
whole_frame_io; the loop's own calls pass MSG_DONTWAIT), so a large payload costs the event loop
nothing, and the next queued frame starts the moment one ends (no event-loop round trip between
frames: with 16 transfers over 8 lanes that round trip left each lane idle between frames).
TLS: by default the socket is a TLS relay's plaintext end (tls_relay.py: the record work runs in a
helper process) and nothing here differs; with ``TransportConfig.tls_procs`` 0, the TCP socket under
a ``TlsChannel`` (tls.py), a large frame encrypted by the writer thread.

Device memory (TransportConfig.tcp_lane_staging): a transfer queues its DATA frames as ``StagedFrame``s
(tx_frame.py); the writer thread issues a frame's device->host copies, waits for them and writes it, and
issues the copies of up to tcp_stage_ahead - 1 frames queued behind it meanwhile.

Frames are written whole and in the order they were handed over (FIFO: the writer thread's queue), so
frames of transfers sharing a lane interleave frame by frame. A write interrupted halfway poisons the
stream: the peer is closed. ``progress`` is the last instant bytes moved either way (the writer thread
updates it too): a transfer past its deadline is failed only when its lane stopped moving
(TransportConfig.stall_timeout_s).
"""

from __future__ import annotations

import asyncio
import queue
import select
import socket
import threading
import time
from collections import deque

from .errors import PeerUnavailable, TransferError
from .iovec import IOV_MAX, advance, whole_frame_io
from .protocol import HEADER_SIZE, Msg, decode_header, decode_meta, encode
from .tls import TlsChannel, client_context, tls_send_blocking
from .tls_relay import client_status
from .tx_frame import StagedFrame


def _sendmsg_blocking(sock: socket.socket, views: list[memoryview], i: int, stop: list[bool],
                      progress: list[float]) -> tuple[int, int, float, float]:
    """Write a frame from the lane's writer thread: the socket is blocking (iovec.whole_frame_io), so one
    sendmsg moves the whole frame (per IOV_MAX buffers) with the GIL released, returning early only at
    IO_TIMEOUT_S (then ``stop`` is checked); poll() covers a call that moved nothing in that time.
    Returns (sendmsg calls, bytes, seconds in poll, seconds in all) for IoStats."""
    start = time.monotonic()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    calls = nbytes = 0
    polled = 0.0
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i:i + IOV_MAX])
        except (BlockingIOError, InterruptedError):
            t = time.monotonic()
            for _fd, ev in poller.poll(100):
                if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    raise ConnectionResetError("socket closed while sending") from None
            polled += time.monotonic() - t
            if stop[0]:
                raise ConnectionAbortedError("connection closed locally while sending") from None
            continue
        progress[0] = time.monotonic()
        calls, nbytes = calls + 1, nbytes + sent
        i = advance(views, i, sent)
    return calls, nbytes, polled, time.monotonic() - start


def _stage_ahead(writes: queue.SimpleQueue, ahead: deque, depth: int) -> None:
    """Take up to ``depth`` more items off the writer queue (never waiting) and issue the copies of the
    StagedFrames among them, so the copy stream works while the frame in hand is on the socket."""
    while len(ahead) < depth and (not ahead or ahead[-1] is not None):
        try:
            ahead.append(writes.get_nowait())
        except queue.Empty:
            break
    for item in ahead:
        if item is not None and isinstance(item[0], StagedFrame):
            item[0].start()


def _set_once(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Lane:
    def __init__(self, peer, index: int) -> None:
        self.peer = peer
        self.t = peer.t
        self.loop = peer.loop
        self.index = index
        self.name = peer.name if index == 0 else f"{peer.name}#{index}"
        self.sock: socket.socket | None = None
        self.chan: TlsChannel | None = None  # with TLS (tls.py)
        self._plain = bytearray()  # TLS: decrypted reply bytes not parsed yet
        self.closed = False
        self.progress = [time.monotonic()]
        self.load = 0  # bytes of the transfers riding this lane now (the least loaded takes the next)
        self.queued_bytes = 0  # bytes of StagedFrames queued on the writer thread and not written yet
        self._writes: queue.SimpleQueue | None = None  # batches for the writer thread (started on first use)
        self._queued = 0  # batches handed to the writer thread and not written yet
        self._stop = [False]
        self.reader: asyncio.Task | None = None

    @property
    def last_progress(self) -> float:
        return self.progress[0]

    # -- setup -------------------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect (and, with TLS, complete the handshake), then start reading replies."""
        cfg = self.t.config
        host, port = self.peer.endpoint["host"], int(self.peer.endpoint["port"])
        try:
            infos = await self.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            sock = self.sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cfg.socket_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.socket_buffer_bytes)
            await asyncio.wait_for(self.loop.sock_connect(sock, addr), cfg.connect_timeout_s)
            if cfg.tls and self.t.relays is not None:
                self.sock = sock = self.t.relays.attach(sock, server_side=False)
                await asyncio.wait_for(self._relay_status(sock), cfg.handshake_timeout_s + 1)
            elif cfg.tls:
                self.chan = TlsChannel(client_context(cfg), server_side=False)
                await asyncio.wait_for(self._tls_handshake(sock), cfg.handshake_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            self.close()
            what = "TLS connection to" if cfg.tls else "connect to"
            raise PeerUnavailable(f"cannot {what} KV receiver {self.name}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        whole_frame_io(self.sock)  # from here on every call on the loop passes MSG_DONTWAIT
        self.progress[0] = time.monotonic()
        self.reader = self.loop.create_task(self._read_loop(), name=f"kvtransfer-peer-{self.name}")

    async def _relay_status(self, sock: socket.socket) -> None:
        """The TLS relay's first byte says whether the handshake succeeded (tls_relay.py)."""
        status = await self.loop.sock_recv(sock, 1)
        if status[:1] == b"\x01":
            return
        while chunk := await self.loop.sock_recv(sock, 4096):
            status += chunk
        raise ConnectionRefusedError(client_status(status))

    async def _tls_handshake(self, sock: socket.socket) -> None:
        out = self.chan.handshake()
        while True:
            if out:
                await self.loop.sock_sendall(sock, out)
            if self.chan.established:
                return
            raw = await self.loop.sock_recv(sock, 1 << 16)
            if not raw:
                raise ConnectionResetError("the receiver closed the connection during the TLS handshake")
            out = self.chan.handshake(raw)

    # -- writing -----------------------------------------------------------------------------------
    async def send_frame(self, msg: Msg, meta: dict, payload: list | None = None,
                         payload_len: int = 0) -> None:
        await self.send_frames([(msg, meta, payload, payload_len)])

    async def send_frames(self, frames: list[tuple[Msg, dict, list | None, int]]) -> None:
        """Write whole frames, several per write while their payload stays within max_frame_bytes (a
        small one-shot transfer is one write: BEGIN + DATA + END)."""
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

    def _lost(self, exc: BaseException) -> PeerUnavailable:
        self.peer.dead(PeerUnavailable(f"KV receiver {self.name} connection lost: {exc}"))
        return PeerUnavailable(f"KV receiver {self.name} connection lost while sending: {exc}")

    async def _write(self, bufs: list) -> None:
        """Write one batch of whole frames, after every batch written before it on this lane (FIFO).

        A small batch (TransportConfig.inline_write_max_bytes) is tried at once on the event loop when
        nothing is queued (BEGIN, WROTE, ...: no thread hop); everything else (and a small batch's part
        that did not fit in the socket buffer) goes to the lane's writer thread, which takes the next
        queued batch the moment one is done: frames of transfers sharing a lane follow each other with
        no event-loop round trip between them. With TLS in this process the thread encrypts too."""
        if self.closed:
            raise PeerUnavailable(f"connection to KV receiver {self.name} is closed")
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        encrypted = False
        if not self._queued and sum(len(v) for v in views) <= self.t.config.inline_write_max_bytes:
            if self.chan is not None:
                views, encrypted = [memoryview(p) for p in self.chan.encrypt(views)], True
            try:
                i = advance(views, 0, self.sock.sendmsg(views[:IOV_MAX], (), socket.MSG_DONTWAIT))
                self.progress[0] = time.monotonic()
            except (BlockingIOError, InterruptedError):
                i = 0
            except OSError as exc:
                raise self._lost(exc) from exc
            if i == len(views):
                return
            views = views[i:]
        write = self.loop.create_future()
        self._queued += 1
        self._writer_queue().put((views, encrypted, write))
        await self._written_or_lost(write)

    def queue_staged(self, frame: StagedFrame) -> asyncio.Future:
        """Hand a frame to the writer thread, behind every batch queued before it; the future resolves
        once it was written (IoStats, or None when it was cancelled unwritten) or fails with the OSError
        that broke the lane (``wait_written``)."""
        if self.closed:
            raise PeerUnavailable(f"connection to KV receiver {self.name} is closed")
        write = self.loop.create_future()
        self._queued += 1
        self.queued_bytes += frame.nbytes
        self._writer_queue().put((frame, False, write))
        return write

    async def wait_written(self, write: asyncio.Future) -> None:
        """Await a queue_staged future; the lane's loss becomes the peer's (PeerUnavailable)."""
        try:
            done = await write
        except OSError as exc:
            raise self._lost(exc) from exc
        if done is not None:
            self.t.io_tx.add(*done)

    async def _written_or_lost(self, write: asyncio.Future) -> None:
        try:
            done = await asyncio.shield(write)
            if done is not None:
                self.t.io_tx.add(*done)
        except asyncio.CancelledError:
            # Let the write finish (the stream must stay in sync) unless it is stuck.
            try:
                await asyncio.wait_for(write, 2.0)
            except BaseException:
                self.peer.dead(PeerUnavailable(f"frame to {self.name} cut short"))
            raise
        except OSError as exc:
            raise self._lost(exc) from exc

    def _writer_queue(self) -> queue.SimpleQueue:
        if self._writes is None:
            self._writes = queue.SimpleQueue()
            threading.Thread(target=self._write_loop, args=(self._writes,), daemon=True,
                             name=f"kvtransfer-send_{self.index}").start()
        return self._writes

    def _write_loop(self, writes: queue.SimpleQueue) -> None:
        """The lane's writer thread: batches in order; after a failed one the stream is broken, so every
        later one fails with the same error (the peer is closed by whoever awaits them). A StagedFrame is
        staged here, the copies of the next queued ones issued before it is written (``_stage_ahead``)."""
        failed: BaseException | None = None
        ahead: deque = deque()  # items taken off the queue early (their staging started)
        depth = self.t.config.tcp_stage_ahead - 1
        while (item := ahead.popleft() if ahead else writes.get()) is not None:
            views, encrypted, fut = item
            frame = views if isinstance(views, StagedFrame) else None
            result: object = None
            if failed is None:
                try:
                    if frame is not None:
                        frame.start()
                        _stage_ahead(writes, ahead, depth)
                        views = frame.buffers()
                    if views is None:  # a cancelled frame: nothing to write
                        pass
                    elif self.chan is not None and not encrypted:
                        result = tls_send_blocking(self.sock, self.chan, views, self._stop, self.progress)
                    else:
                        result = _sendmsg_blocking(self.sock, views, 0, self._stop, self.progress)
                    if frame is not None:
                        frame.times[3] = time.monotonic()
                except BaseException as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
                    failed = exc
            try:
                self.loop.call_soon_threadsafe(self._written, fut, result, failed,
                                               frame.nbytes if frame is not None else 0)
            except RuntimeError:  # the event loop is gone (interpreter teardown): nobody waits
                return

    def _written(self, fut: asyncio.Future, result, failed: BaseException | None, staged: int) -> None:
        self._queued -= 1
        self.queued_bytes -= staged
        if fut.done():
            return
        if failed is not None:
            fut.set_exception(failed if isinstance(failed, OSError) else OSError(str(failed)))
        else:
            fut.set_result(result)

    # -- reading -----------------------------------------------------------------------------------
    async def _recv_exact(self, n: int) -> bytes | bytearray:
        if self.chan is not None:
            scratch = memoryview(bytearray(1 << 16))
            while len(self._plain) < n:
                got = self.chan.decrypt_into(scratch)
                if got:
                    self._plain += scratch[:got]
                    continue
                got = await self._recv_into(scratch)
                if not got:
                    raise PeerUnavailable(f"KV receiver {self.name} closed the connection")
                self.chan.feed(scratch[:got])
            data, self._plain = self._plain[:n], self._plain[n:]
            self.progress[0] = time.monotonic()
            return data
        buf = bytearray(n)
        view, pos = memoryview(buf), 0
        while pos < n:
            got = await self._recv_into(view[pos:])
            if not got:
                raise PeerUnavailable(f"KV receiver {self.name} closed the connection")
            pos += got
        self.progress[0] = time.monotonic()
        return buf

    async def _recv_into(self, view: memoryview) -> int:
        """One receive on the event loop: whatever is there (MSG_DONTWAIT: the socket itself is blocking
        for the writer thread, iovec.whole_frame_io), else wait until the socket is readable."""
        while True:
            try:
                return self.sock.recv_into(view, 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                pass
            ready = self.loop.create_future()
            fd = self.sock.fileno()
            self.loop.add_reader(fd, _set_once, ready)
            try:
                await ready
            finally:
                self.loop.remove_reader(fd)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg, _flags, meta_len, _plen = decode_header(await self._recv_exact(HEADER_SIZE))
                self.peer.dispatch(self, msg, decode_meta(await self._recv_exact(meta_len)))
        except asyncio.CancelledError:
            raise
        except (OSError, TransferError) as exc:
            if not isinstance(exc, TransferError):
                exc = PeerUnavailable(f"KV receiver {self.name} connection lost: {exc}")
            self.peer.dead(exc)

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop[0] = True
        if self._writes is not None:
            self._writes.put(None)  # the writer thread ends after the batch in hand (it sees _stop)
        sock, self.sock = self.sock, None
        reader = self.reader
        if reader is not None and not reader.done() and reader is not asyncio.current_task():
            # Close the socket only once the reader has unregistered it: its fd number may be reused.
            reader.cancel()
            if sock is not None:
                reader.add_done_callback(lambda _t: sock.close())
        elif sock is not None:
            sock.close()
