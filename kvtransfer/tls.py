"""Mutual TLS for the KV plane: the SSL contexts of the listener and of the sender's connections.

Both sides present a certificate and require one signed by the cluster CA (``TransportConfig.tls_ca``),
so a process without such a certificate is refused during the TLS handshake on every KV port, before a
byte of the pdkv protocol is read. Identity is membership of the cluster: workers dial each other by the
advertised IP, which a certificate made before the pod was scheduled cannot name, so the host name is
not checked (``check_hostname`` off); the chain to the cluster CA is (``CERT_REQUIRED``).

Every TLS connection is a ``TlsChannel``: an ``ssl.SSLObject`` over two memory BIOs. By default it
lives in a TLS relay helper process (tls_relay.py), which pumps records between the TCP socket and a
socketpair whose other end the worker reads and writes as plaintext: CPython's ``ssl`` holds one
process at one GIL's worth of 16 KiB record calls (~1-1.5 GB/s), and each helper has a GIL of its own.
With ``TransportConfig.tls_procs`` 0 it lives in the worker instead, on the plaintext path's
non-blocking socket: small frames on the event loop, a large frame's crypto on that connection's I/O
thread (the lane's writer thread; the receiving connection's read thread), the GIL released.

NIXL's metadata (the agent blob and the registered region) is only handed out in HELLO_OK on such an
authenticated connection, and the receiver accepts NIXL completions only from agents named in a HELLO
on one (receiver.py), so the NIXL plane inherits the same admission.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time
from pathlib import Path

from .config import TransportConfig
from .iovec import IOV_MAX, advance

# Plaintext encrypted (or decrypted) per lock hold: bounds how long the event loop can wait for the
# channel while an I/O thread holds it, and the ciphertext held in memory at once.
_CHUNK = 1 << 20
# Plaintext per memory-BIO write (TlsChannel.encrypt).
_PIECE = 1 << 20


def _load(ctx: ssl.SSLContext, cfg: TransportConfig) -> ssl.SSLContext:
    for what, path in (("CA", cfg.tls_ca), ("certificate", cfg.tls_cert), ("key", cfg.tls_key)):
        if not Path(str(path)).is_file():
            raise ValueError(f"KV TLS {what} file {path!r} does not exist")
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    ctx.load_verify_locations(cafile=cfg.tls_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def server_context(cfg: TransportConfig) -> ssl.SSLContext | None:
    """The listener's context (None without TLS): client certificates required."""
    if not cfg.tls:
        return None
    return _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cfg)


def client_context(cfg: TransportConfig) -> ssl.SSLContext | None:
    """The sender's context (None without TLS): the receiver's chain is verified, its name is not."""
    if not cfg.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    return _load(ctx, cfg)


class TlsChannel:
    """One TLS connection's state, driven by whoever moves its bytes. Calls are serialised by a lock
    (OpenSSL objects are not safe to use from two threads at once): the event loop encrypts and
    decrypts small frames, an I/O thread a large frame, up to _CHUNK bytes per hold. Records leave in
    the order they were made: encrypt() returns everything the BIO holds, and the callers write one
    frame at a time per connection (a lane's writer thread, or its loop when nothing is queued; the
    receiver writes only from the loop; a relay from its one pumping thread)."""

    def __init__(self, ctx: ssl.SSLContext, *, server_side: bool, piece: int = _PIECE) -> None:
        self.piece = piece  # plaintext per memory-BIO write in encrypt()
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=server_side)
        self._lock = threading.Lock()
        self.established = False

    def handshake(self, data: bytes = b"") -> bytes:
        """Feed bytes from the peer, advance the handshake; returns bytes to send to the peer. Raises
        ssl.SSLError when the handshake fails (a peer without a certificate of the cluster CA)."""
        with self._lock:
            if data:
                self._in.write(data)
            if not self.established:
                try:
                    self._obj.do_handshake()
                    self.established = True
                except ssl.SSLWantReadError:
                    pass
            return self._out.read()

    def encrypt(self, views) -> list[bytes]:
        """TLS records of these plaintext views (at most _CHUNK bytes in all, or one call per chunk),
        after whatever records the channel already holds, as pieces of at most ~piece bytes of
        plaintext each, to be written in order (one sendmsg). One piece per MiB was the fastest on the
        H200 host (bench/tls_probe.py --relay 8 --pieces 32,96,1024: 6.4 / 6.9 / 8.4 GB/s through
        relay pairs); smaller pieces mean more calls, each with its memory-BIO round trip."""
        out = []
        with self._lock:
            pending = self._out.read()  # records the handshake (or a read) left for the peer
            if pending:
                out.append(pending)
            for view in views:
                for pos in range(0, len(view), self.piece):
                    self._obj.write(view[pos:pos + self.piece])
                    out.append(self._out.read())
        return out

    def feed(self, data) -> None:
        with self._lock:
            self._in.write(data)

    def decrypt_into(self, view: memoryview) -> int:
        """Plaintext into view (up to _CHUNK bytes); 0 when the bytes fed so far hold no more. Raises
        ConnectionResetError at the peer's close_notify, ssl.SSLError on a bad record."""
        with self._lock:
            try:
                got = self._obj.read(min(len(view), _CHUNK), view)
            except ssl.SSLWantReadError:
                return 0
            except ssl.SSLZeroReturnError:
                raise ConnectionResetError("TLS peer closed the connection") from None
        if got == 0 and len(view):
            raise ConnectionResetError("TLS peer closed the connection")
        return got

    def decrypt_all_into(self, view: memoryview) -> int:
        """Plaintext of every whole record the channel holds, into view until it is full, under one lock
        hold (a TLS relay's hot loop: one record, 16 KiB at most, per read call); 0 when there is none.
        Raises as decrypt_into; plaintext already placed is returned first, the close on the next call."""
        pos, read = 0, self._obj.read
        with self._lock:
            while pos < len(view):
                try:
                    got = read(len(view) - pos, view[pos:])
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:
                    if pos:
                        break
                    raise ConnectionResetError("TLS peer closed the connection") from None
                if not got:
                    if pos:
                        break
                    raise ConnectionResetError("TLS peer closed the connection")
                pos += got
        return pos


def sendall_parts(sock: socket.socket, parts: list) -> None:
    """Write every part, in order, on a blocking socket (sendmsg: one syscall for many parts)."""
    views = [memoryview(p) for p in parts if len(p)]
    i = 0
    while i < len(views):
        i = advance(views, i, sock.sendmsg(views[i:i + IOV_MAX]))


def _wait(poller, stop: list[bool], what: str) -> float:
    t = time.monotonic()
    for _fd, ev in poller.poll(100):
        if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) and not ev & select.POLLIN:
            raise ConnectionResetError(f"socket closed while {what}") from None
    if stop[0]:
        raise ConnectionAbortedError(f"connection closed locally while {what}") from None
    return time.monotonic() - t


def tls_send_blocking(sock: socket.socket, chan: TlsChannel, views: list[memoryview], stop: list[bool],
                      progress: list[float]) -> tuple[int, int, float, float]:
    """Encrypt and write a frame from an I/O thread, _CHUNK of plaintext at a time. Returns (sendmsg
    calls, bytes, seconds in poll, seconds in all) as lane._sendmsg_blocking."""
    start = time.monotonic()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    calls = nbytes = 0
    polled = 0.0
    for view in views:
        for pos in range(0, max(1, len(view)), _CHUNK):
            parts = [memoryview(p) for p in chan.encrypt([view[pos:pos + _CHUNK]])]
            i = 0
            while i < len(parts):
                try:
                    sent = sock.sendmsg(parts[i:])
                except (BlockingIOError, InterruptedError):
                    polled += _wait(poller, stop, "sending")
                    continue
                progress[0] = time.monotonic()
                calls, nbytes = calls + 1, nbytes + sent
                i = advance(parts, i, sent)
    return calls, nbytes, polled, time.monotonic() - start


def tls_recv_all(fd: int, chan: TlsChannel, views: list[memoryview], stop: list[bool],
                 progress: list[float]) -> tuple[int, int, float, float, None]:
    """Fill views with plaintext from an I/O thread: what the channel already holds first, then
    ciphertext read from the (non-blocking) socket fd, decrypted straight into the views. Returns
    (read calls, bytes, seconds in poll, seconds in all, None) as rx_conn._recv_all (no next frame
    head: the loop decrypts what the thread read past its frame, ``RxConnection._pump``)."""
    start = time.monotonic()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    calls = nbytes = 0
    polled = 0.0
    raw = memoryview(bytearray(_CHUNK))
    for view in views:
        pos = 0
        while pos < len(view):
            got = chan.decrypt_into(view[pos:])
            if got:
                pos += got
                continue
            try:
                n = os.readv(fd, [raw])
            except (BlockingIOError, InterruptedError):
                polled += _wait(poller, stop, "receiving")
                continue
            if not n:
                raise ConnectionResetError("sender closed the connection mid-frame")
            progress[0] = time.monotonic()
            calls, nbytes = calls + 1, nbytes + n
            chan.feed(raw[:n])
    return calls, nbytes, polled, time.monotonic() - start, None
