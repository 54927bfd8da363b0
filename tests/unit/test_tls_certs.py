"""`pdserve certs init` and the gRPC credentials built from its files (pdserve/tls.py).

The certificates: written with private keys 0600, chained to the cluster CA, naming their role, the
loopback names and any extra host; an existing CA is never overwritten silently. The credentials,
against an in-process gRPC server holding a worker's certificate and requiring client certificates:
the cluster's client certificate is served; plaintext, no certificate, a certificate of another CA,
and a server whose certificate names another role are all refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import stat

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pdserve.app.certs import init_certs
from pdserve.tls import IDENTITIES, TlsDir, open_channel


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cluster = tmp_path_factory.mktemp("tls")
    stranger = tmp_path_factory.mktemp("tls-other")
    init_certs(cluster, hosts=["router.example.com", "10.1.2.3"], days=2)
    init_certs(stranger, days=2)
    return cluster, stranger


def test_files_names_and_chain(dirs) -> None:
    d, other = dirs
    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name in IDENTITIES:
        assert stat.S_IMODE((d / f"{name}.key").stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate((d / f"{name}.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {name, "localhost", "router.example.com"} <= set(san.get_values_for_type(x509.DNSName))
        assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.1.2.3")} <= \
            set(san.get_values_for_type(x509.IPAddress))
    assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    stranger = x509.load_pem_x509_certificate((other / "client.crt").read_bytes())
    with pytest.raises(ValueError):  # another issuer (each CA has its own name)
        stranger.verify_directly_issued_by(ca)


def test_existing_ca_is_not_replaced_without_force(dirs) -> None:
    d, _ = dirs
    before = (d / "ca.crt").read_bytes()
    with pytest.raises(FileExistsError):
        init_certs(d)
    assert (d / "ca.crt").read_bytes() == before
    with pytest.raises(ValueError, match="no ca.crt"):
        TlsDir(d / "missing")


async def _check(address: str, **kw) -> grpc.StatusCode:
    async with open_channel(address, aio=True, **kw) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_worker_port_requires_a_cluster_client_certificate(dirs) -> None:
    asyncio.run(_worker_port(*dirs))


async def _worker_port(d, other) -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    creds = TlsDir(d).server_credentials("decode", require_client_cert=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    addr = f"127.0.0.1:{port}"
    try:
        cluster, stranger = TlsDir(d), TlsDir(other)
        assert await _check(addr, tls=cluster, identity="router", server_role="decode") == grpc.StatusCode.OK
        assert await _check(addr, tls=cluster, identity="client", server_role="decode") == grpc.StatusCode.OK
        refused = grpc.StatusCode.UNAVAILABLE
        assert await _check(addr, tls=None) == refused                                    # plaintext
        assert await _check(addr, tls=cluster, identity=None, server_role="decode") == refused  # no cert
        # a certificate of another CA (trusting the cluster's CA to get that far)
        foreign = _mixed(stranger, cluster)
        assert await _check(addr, tls=foreign, identity="client", server_role="decode") == refused
        # the server's certificate names "decode": a caller that wants a prefill worker refuses it
        assert await _check(addr, tls=cluster, identity="router", server_role="prefill") == refused
    finally:
        await server.stop(None)


def _mixed(identity_from: TlsDir, ca_from: TlsDir) -> TlsDir:
    """Another CA's client identity, with the cluster's CA to verify the server."""
    class Mixed(TlsDir):
        def ca(self) -> bytes:
            return ca_from.ca()
    return Mixed(identity_from.path)
