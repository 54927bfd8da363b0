"""TLS for every gRPC port of a cluster, from one directory of PEM files (``--tls-dir DIR``).

The directory (``pdserve certs init DIR`` writes it; cert-manager Secrets mount the same names)::

    ca.crt                      the cluster CA: every peer is verified against it
    <name>.crt  <name>.key      one identity per component: router, prefill, decode, colocated, client

A server presents ``<its role>.crt``. The router's public port takes TLS without a client
certificate (clients authenticate with API keys, if at all); every internal port (prefill, decode,
colocated workers) *requires* a client certificate signed by the cluster CA, so only members of
the cluster can call a worker. A caller presents its own ``<name>.crt`` (the router presents
router.crt to workers) and checks that the server's certificate names the role it meant to reach:
workers are dialled by IP, so the channel asks for the role name (``ssl_target_name_override``),
which ``certs init`` puts in each certificate's subjectAltName; a decode certificate cannot pass for
a prefill worker. The KV plane uses the same files (kvtransfer/tls.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

CA_FILE = "ca.crt"
IDENTITIES = ("router", "prefill", "decode", "colocated", "client")


@dataclass(frozen=True)
class TlsDir:
    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if not (self.path / CA_FILE).is_file():
            raise ValueError(f"--tls-dir {self.path}: no {CA_FILE} (write one with `pdserve certs init DIR`)")

    def _read(self, name: str) -> bytes:
        f = self.path / name
        if not f.is_file():
            raise ValueError(f"--tls-dir {self.path}: {name} is missing")
        return f.read_bytes()

    def ca(self) -> bytes:
        return self._read(CA_FILE)

    def pair(self, name: str) -> tuple[bytes, bytes]:
        """(private key, certificate chain) of identity ``name``."""
        return self._read(f"{name}.key"), self._read(f"{name}.crt")

    def has(self, name: str) -> bool:
        return (self.path / f"{name}.crt").is_file() and (self.path / f"{name}.key").is_file()

    def server_credentials(self, name: str, *, require_client_cert: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([self.pair(name)], root_certificates=self.ca(),
                                           require_client_auth=require_client_cert)

    def channel_credentials(self, name: str | None) -> grpc.ChannelCredentials:
        """Verify the server against the cluster CA; present identity ``name`` (None: no certificate)."""
        key, chain = self.pair(name) if name else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self.ca(), private_key=key,
                                            certificate_chain=chain)


KEEPALIVE_TIME_MS = 10_000
# A channel's keepalive: a ping after 10 s without one, and the transport (every call on it) given up
# when a ping goes 5 s unanswered, so a frozen peer (SIGSTOP, a hung driver: its TCP connection stays
# open) is noticed within 10-15 s (docs/faults.md). ``grpc.http2.ping_timeout_ms`` is set because
# gRPC's own default for a ping's ack (1 minute) governs keepalive pings too; without a cap on pings
# without data, gRPC stops pinging a peer that sends nothing after two. Servers must accept the
# pings (pdserve/server.py GRPC_OPTIONS).
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def server_name_option(role: str) -> list[tuple[str, str]]:
    """Channel option: the server must hold a certificate for ``role`` (whatever address it is dialled at)."""
    return [("grpc.ssl_target_name_override", role)]


def open_channel(address: str, *, tls: TlsDir | None, identity: str | None = None, server_role: str = "",
                 options: list | None = None, aio: bool = False):
    """A channel to ``address``: plaintext without ``tls``, else TLS verified against the cluster CA."""
    opts = list(options or [])
    mod = grpc.aio if aio else grpc
    if tls is None:
        return mod.insecure_channel(address, options=opts)
    if server_role:
        opts += server_name_option(server_role)
    return mod.secure_channel(address, tls.channel_credentials(identity), options=opts)
