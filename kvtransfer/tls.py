"""Mutual TLS for the KV plane: the SSL contexts of the listener and of the sender's connections.

Both sides present a certificate and require one signed by the cluster CA (``TransportConfig.tls_ca``),
so a process without such a certificate is refused during the TLS handshake on every KV port, before a
byte of the pdkv protocol is read. Identity is membership of the cluster: workers dial each other by the
advertised IP, which a certificate made before the pod was scheduled cannot name, so the host name is
not checked (``check_hostname`` off); the chain to the cluster CA is (``CERT_REQUIRED``).

NIXL's metadata (the agent blob and the registered region) is only handed out in HELLO_OK on such an
authenticated connection, and the receiver accepts NIXL completions only from agents named in a HELLO
on one (receiver.py), so the NIXL plane inherits the same admission.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from .config import TransportConfig


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
