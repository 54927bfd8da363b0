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
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

from .config import TransportConfig
from .tls import TlsChannel, client_context, server_context

log = logging.getLogger("kvtransfer.tls_relay")
_CHUNK = 1 << 20  # bytes moved per write either way
_OK, _FAIL = b"\x01", b"\x00"
_SERVER, _CLIENT = b"S", b"C"


# -- the owner's side ---------------------------------------------------------------------------------
class _Helper:
    def __init__(self, cfg: TransportConfig, index: int) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtransfer.tls_relay", "--ctrl-fd", str(theirs.fileno()),
             "--ca", str(cfg.tls_ca), "--cert", str(cfg.tls_cert), "--key", str(cfg.tls_key),
             "--handshake-timeout", str(cfg.handshake_timeout_s), "--name", f"kv-tls-{index}"],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.ctrl = mine
        self.index = index

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

    def __init__(self, cfg: TransportConfig, procs: int) -> None:
        self.cfg = cfg
        self.procs = procs
        self._helpers: list[_Helper | None] = [None] * procs
        self._next = 0
        self._lock = threading.Lock()
        self.handed = 0  # connections handed to helpers (stats)
        self.restarts = 0  # helpers started again after dying

    def start(self) -> None:
        with self._lock:
            for i in range(self.procs):
                if self._helpers[i] is None:
                    self._helpers[i] = _Helper(self.cfg, i)

    def attach(self, sock: socket.socket, *, server_side: bool) -> socket.socket:
        """Hand a connected TCP socket to a helper (it is closed here); returns the plaintext end, a
        non-blocking AF_UNIX stream socket. A sender then reads the status byte (``client_status``)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
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
                        helper = self._helpers[i] = _Helper(self.cfg, i)
                    try:
                        socket.send_fds(helper.ctrl, [_SERVER if server_side else _CLIENT],
                                        [sock.fileno(), theirs.fileno()])
                        break
                    except OSError:
                        if attempt:
                            mine.close()
                            raise
                        helper.proc.kill()
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


def _pump_in(tcp: socket.socket, plain: socket.socket, chan: TlsChannel) -> None:
    """Peer -> owner: decrypt whatever the received ciphertext holds (up to _CHUNK) before each write."""
    raw, out = memoryview(bytearray(_CHUNK)), memoryview(bytearray(_CHUNK))
    pos = 0
    try:
        while True:
            got = chan.decrypt_into(out[pos:]) if pos < _CHUNK else 0
            if got:
                pos += got
                continue
            if pos:
                plain.sendall(out[:pos])
                pos = 0
                continue
            n = tcp.recv_into(raw)
            if not n:
                return
            chan.feed(raw[:n])
    except (OSError, ssl.SSLError):
        return
    finally:
        _shut(tcp, plain)


def _pump_out(tcp: socket.socket, plain: socket.socket, chan: TlsChannel) -> None:
    """Owner -> peer: encrypt what the owner wrote, up to _CHUNK per record batch."""
    buf = memoryview(bytearray(_CHUNK))
    try:
        while True:
            n = plain.recv_into(buf)
            if not n:
                return
            tcp.sendall(chan.encrypt([buf[:n]]))
    except (OSError, ssl.SSLError):
        return
    finally:
        _shut(tcp, plain)


def _serve(tcp: socket.socket, plain: socket.socket, ctx: ssl.SSLContext, server_side: bool,
           timeout: float) -> None:
    chan = TlsChannel(ctx, server_side=server_side)
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
        side = (contexts[msg], msg == _SERVER, args.handshake_timeout)
        threading.Thread(target=_serve, args=(tcp, plain, *side), daemon=True).start()
    os._exit(0)  # connection threads are daemons: the owner is gone, so are they


if __name__ == "__main__":
    main()
