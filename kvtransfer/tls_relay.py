"""Mutual TLS of the KV plane's TCP connections, done by helper processes ("relays").

Why: CPython's ``ssl`` decrypts one TLS record (16 KiB) per call and takes the GIL back after each, so
every TLS connection of one process shares one GIL's worth of record calls: ~1.3-1.5 GB/s per process
whatever the number of connections or threads (bench/tls_probe.py; docs/security.md), against 10+ GB/s
of plaintext KV over 8 connections. A helper process has a GIL of its own, so N helpers decrypt N
connections in parallel.

How: the process that owns a connection (a sender's ``Lane`` once connected, the receiver once it
accepted) hands the TCP socket and one end of a fresh ``socketpair`` to a helper (SCM_RIGHTS over the
helper's control socket) and keeps the other end. From then on it speaks plaintext pdkv on that end,
the same code as without TLS (zero-copy ``sendmsg``/``readv`` into the KV blocks or staging). The
helper runs the mutual TLS handshake (a certificate of the cluster CA required, within
``handshake_timeout_s``: tls.py's contexts) and then pumps bytes both ways: ciphertext from the peer
is decrypted into the socketpair, plaintext from it is encrypted to the peer, up to 1 MiB per
write. Nothing listens anew: a socketpair has no address, and the helper holds no socket of its own.

The sender learns the handshake's outcome from one status byte the helper writes first on the
socketpair (``b"\\x01"``, or ``b"\\x00"`` + the reason, then close). The receiver side gets none: a
peer that fails the handshake is a connection that closes before its first byte.

``TlsRelays`` (the owner's side): ``procs`` helpers started with the transport, connections handed out
round robin. One that died is started again at the next hand-off; a connection it carried breaks like
a reset one. Helpers exit when their control socket closes (the owner's ``close()`` or its death).
Run as ``python -m kvtransfer.tls_relay`` by ``TlsRelays``; the package's heavy modules (torch) are
not imported there.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

from .config import TransportConfig
from .tls import TlsChannel, client_context, sendall_parts, server_context

log = logging.getLogger("kvtransfer.tls_relay")
_CHUNK = 1 << 20  # bytes moved per write either way
_BUFFERS = 4  # per direction of a connection, between its reading and its writing thread
_FLUSH_S = 10.0  # at a clean end, how long what was read may take to be written out
_SOCKBUF = 4 << 20  # the socketpair's buffers (SO_SNDBUF/SO_RCVBUF ask; the kernel may cap them)
_OK, _FAIL = b"\x01", b"\x00"
_SERVER, _CLIENT = b"S", b"C"


# -- the owner's side ---------------------------------------------------------------------------------
class _Helper:
    def __init__(self, cfg: TransportConfig, index: int, piece: int | None) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Run from the directory holding this package (python -m puts the working directory first on
        # the path), with the certificate paths made absolute.
        root = str(Path(__file__).resolve().parent.parent)
        files = [str(Path(str(p)).resolve()) for p in (cfg.tls_ca, cfg.tls_cert, cfg.tls_key)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtransfer.tls_relay", "--ctrl-fd", str(theirs.fileno()),
             "--ca", files[0], "--cert", files[1], "--key", files[2],
             "--handshake-timeout", str(cfg.handshake_timeout_s), "--name", f"kv-tls-{index}",
             *(["--piece", str(piece)] if piece else [])],
            pass_fds=(theirs.fileno(),), cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.ctrl = mine

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, wait_s: float = 2.0) -> None:
        self.ctrl.close()  # the helper exits at EOF, dropping its connections
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class TlsRelays:
    """The helper processes of one transport (see the module docstring)."""

    def __init__(self, cfg: TransportConfig, procs: int, *, piece: int | None = None) -> None:
        self.cfg = cfg
        self.procs = procs
        self.piece = piece  # TlsChannel's encrypt piece in the helpers (None: its default; benchmarks)
        self._helpers: list[_Helper | None] = [None] * procs
        self._next = 0
        self._lock = threading.Lock()
        self.handed = 0  # connections handed to helpers (stats)
        self.restarts = 0  # helpers started again after dying

    def start(self) -> None:
        with self._lock:
            for i in range(self.procs):
                if self._helpers[i] is None:
                    self._helpers[i] = _Helper(self.cfg, i, self.piece)

    def attach(self, sock: socket.socket, *, server_side: bool) -> socket.socket:
        """Hand a connected TCP socket to a helper (it is closed here); returns the plaintext end, a
        non-blocking AF_UNIX stream socket. A sender then reads the status byte (``client_status``)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (mine, theirs):
            _grow_buffers(end)
        try:
            with self._lock:
                i = self._next % self.procs
                self._next += 1
                for attempt in (0, 1):
                    helper = self._helpers[i]
                    if helper is None or not helper.alive():
                        if helper is not None:
                            log.warning("kvtransfer: TLS relay %d exited (status %s); starting it again",
                                        i, helper.proc.returncode)
                            helper.close(0)
                            self.restarts += 1
                        helper = self._helpers[i] = _Helper(self.cfg, i, self.piece)
                    try:
                        socket.send_fds(helper.ctrl, [_SERVER if server_side else _CLIENT],
                                        [sock.fileno(), theirs.fileno()])
                        break
                    except OSError:
                        if attempt:
                            mine.close()
                            raise
                        helper.proc.kill()  # its control socket is broken: start another one
                        helper.proc.wait()
                self.handed += 1
        finally:
            sock.close()
            theirs.close()
        mine.setblocking(False)
        return mine

    def close(self) -> None:
        with self._lock:
            helpers, self._helpers = self._helpers, [None] * self.procs
        for helper in helpers:
            if helper is not None:
                helper.close()

    def pids(self) -> list[int]:
        return [h.proc.pid for h in self._helpers if h is not None and h.alive()]


def _grow_buffers(sock: socket.socket) -> None:
    """Ask for _SOCKBUF each way (SO_*BUFFORCE where allowed: root may pass net.core.*mem_max); the
    default ~200 KiB made a 1 MiB write five round trips between the relay and its owner."""
    for force, plain in ((getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF),
                         (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force if force is not None else plain, _SOCKBUF)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, plain, _SOCKBUF)


def client_status(data: bytes) -> str | None:
    """None when the helper's status bytes say the handshake succeeded, else the reason."""
    if data[:1] == _OK:
        return None
    return data[1:].decode("utf-8", "replace") or "the TLS relay closed the connection"


# -- the helper's side --------------------------------------------------------------------------------
def _handshake(tcp: socket.socket, chan: TlsChannel, server_side: bool) -> None:
    out = b"" if server_side else chan.handshake()
    while True:
        if out:
            tcp.sendall(out)
        if chan.established:
            return
        data = tcp.recv(1 << 16)
        if not data:
            raise ConnectionResetError("the peer closed the connection during the TLS handshake")
        out = chan.handshake(data)


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Stage:
    """Two threads per direction with _BUFFERS buffers between them, so that reading (and the crypto on
    one side of it) overlaps writing: with one thread, each chunk waited for the next socket to take
    the previous one. ``fill(view) -> bytes put in view (0: end)`` runs on the calling thread,
    ``drain(view)`` on a second one."""

    def __init__(self, fill, drain, socks: tuple[socket.socket, socket.socket]) -> None:
        self.fill, self.drain, self.socks = fill, drain, socks
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.full: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(_BUFFERS):
            self.free.put(memoryview(bytearray(_CHUNK)))

    def run(self) -> None:
        """Until the reading side ends. At its end (EOF, or the TLS peer's close_notify) what was read is
        written out first (within _FLUSH_S: a last ERROR frame before a close reaches the other side);
        on an error both sockets are shut at once. Either way both are shut after, which ends the other
        direction's stage too."""
        writer = threading.Thread(target=self._write, daemon=True)
        writer.start()
        try:
            while True:
                buf = self.free.get()
                if buf is None:
                    return  # the writer failed
                n = self.fill(buf)
                if not n:
                    return
                self.full.put((buf, n))
        except (OSError, ssl.SSLError):
            _shut(*self.socks)
        finally:
            self.full.put(None)
            writer.join(_FLUSH_S)
            _shut(*self.socks)
            writer.join()

    def _write(self) -> None:
        try:
            while (item := self.full.get()) is not None:
                buf, n = item
                self.drain(buf[:n])
                self.free.put(buf)
        except (OSError, ssl.SSLError):
            _shut(*self.socks)
            self.free.put(None)


def _pump_in(tcp: socket.socket, plain: socket.socket, chan: TlsChannel) -> None:
    """Peer -> owner: ciphertext read and decrypted on this thread (whatever is there, up to _CHUNK of
    plaintext per buffer), written to the owner by a second one."""
    raw = memoryview(bytearray(_CHUNK))

    def fill(out: memoryview) -> int:
        while True:
            try:
                got = chan.decrypt_all_into(out)
            except ConnectionResetError:  # the peer's close_notify: a clean end, like EOF
                return 0
            if got:
                return got
            n = tcp.recv_into(raw)
            if not n:
                return 0
            chan.feed(raw[:n])

    _Stage(fill, plain.sendall, (tcp, plain)).run()


def _pump_out(tcp: socket.socket, plain: socket.socket, chan: TlsChannel) -> None:
    """Owner -> peer: plaintext read on this thread, encrypted and sent by a second one."""
    _Stage(plain.recv_into, lambda view: sendall_parts(tcp, chan.encrypt([view])), (tcp, plain)).run()


def _serve(tcp: socket.socket, plain: socket.socket, ctx: ssl.SSLContext, server_side: bool,
           timeout: float, piece: int | None) -> None:
    chan = TlsChannel(ctx, server_side=server_side, **({"piece": piece} if piece else {}))
    try:
        tcp.settimeout(timeout)
        plain.setblocking(True)
        try:
            _handshake(tcp, chan, server_side)
        except (OSError, ssl.SSLError) as exc:
            if not server_side:
                try:
                    why = f"TLS handshake failed: {type(exc).__name__}: {exc}"
                    plain.sendall(_FAIL + why.encode()[:1000])
                except OSError:
                    pass
            return
        tcp.settimeout(None)
        if not server_side:
            plain.sendall(_OK)
        out = threading.Thread(target=_pump_out, args=(tcp, plain, chan), daemon=True)
        out.start()
        _pump_in(tcp, plain, chan)
        out.join()
    except OSError:
        pass
    finally:
        _shut(tcp, plain)
        tcp.close()
        plain.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvtransfer.tls_relay")
    ap.add_argument("--ctrl-fd", type=int, required=True)
    ap.add_argument("--ca", required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--handshake-timeout", type=float, default=10.0)
    ap.add_argument("--name", default="kv-tls")
    ap.add_argument("--piece", type=int, default=None, help="plaintext per memory-BIO write (TlsChannel)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    cfg = TransportConfig(tls_ca=args.ca, tls_cert=args.cert, tls_key=args.key)
    contexts = {_SERVER: server_context(cfg), _CLIENT: client_context(cfg)}
    ctrl = socket.socket(fileno=args.ctrl_fd)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctrl, 64, 2)
        except OSError:
            break
        if not msg and not fds:
            break  # the owner closed its end, or exited
        if len(fds) != 2 or msg not in contexts:
            for fd in fds:
                os.close(fd)
            continue
        tcp, plain = socket.socket(fileno=fds[0]), socket.socket(fileno=fds[1])
        side = (contexts[msg], msg == _SERVER, args.handshake_timeout, args.piece)
        threading.Thread(target=_serve, args=(tcp, plain, *side), daemon=True).start()
    os._exit(0)  # connection threads are daemons: the owner is gone, so are they


if __name__ == "__main__":
    main()
