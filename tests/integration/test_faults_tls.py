"""TLS on every gRPC port: a 1P1D cluster started with ``tls_dir`` (``pdserve up --tls-dir``) on 127.0.0.1.

- greedy output over TLS equals one in-process engine's;
- a plaintext client is refused by the router and by every worker;
- on every worker port (internal: mutual TLS) a client without a certificate, or with one signed by
  another CA, is refused, while the cluster's client certificate is served;
- no listening socket of any process of the cluster is bound to anything but 127.0.0.1.
"""

from __future__ import annotations

import os
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.app.certs import init_certs
from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.tls import TlsDir, open_channel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    model = make_checkpoint("llama")
    tls, stranger = tmp_path_factory.mktemp("tls"), tmp_path_factory.mktemp("stranger")
    init_certs(tls)
    init_certs(stranger)
    with LocalCluster(model, prefill=1, decode=1, transport="tcp", run_dir=tmp_path_factory.mktemp("tlsrun"),
                      tls_dir=str(tls)) as c:
        c.model, c.tls, c.stranger = model, tls, stranger
        c.start_free = c.free_blocks()
        yield c
        stats = c.wait_idle(c.start_free)
        assert {w: s.free_blocks for w, s in stats.items()} == c.start_free


def health(address: str, **kw) -> grpc.StatusCode:
    with open_channel(address, **kw) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_greedy_output_unchanged_with_tls(cluster) -> None:
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    prompts = [[(7 * i + 13 * n) % 1000 + 5 for i in range(n)] for n in (3, 17, 40)]
    want = LLMEngine(EngineConfig(model=str(cluster.model), num_blocks=256, device="cpu")).generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    with Client(cluster.router, timeout=60, tls_dir=str(cluster.tls)) as c:
        got = [c.generate(prompt_ids=p, max_tokens=8, ignore_eos=True).token_ids for p in prompts]
    assert got == want


def test_plaintext_refused_everywhere(cluster) -> None:
    for address in (cluster.router, *(h.address for h in cluster.workers)):
        assert health(address, tls=None) == grpc.StatusCode.UNAVAILABLE, address
    with Client(cluster.router, timeout=10) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(prompt_ids=[5, 6], max_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_internal_ports_require_a_certificate_of_the_cluster(cluster) -> None:
    ours = TlsDir(cluster.tls)

    class Foreign(TlsDir):  # another CA's client certificate; the cluster's CA to verify the server
        def ca(self) -> bytes:
            return ours.ca()

    foreign = Foreign(cluster.stranger)
    for h in cluster.workers:
        role = h.role
        assert health(h.address, tls=ours, identity="client", server_role=role) == grpc.StatusCode.OK
        assert health(h.address, tls=ours, identity=None, server_role=role) == grpc.StatusCode.UNAVAILABLE
        assert health(h.address, tls=foreign, identity="client", server_role=role) == \
            grpc.StatusCode.UNAVAILABLE
    # the router's public port takes TLS clients without a certificate
    assert health(cluster.router, tls=ours, identity=None, server_role="router") == grpc.StatusCode.OK


def _listening(pid: int) -> list[str]:
    """Local addresses of the TCP sockets ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    raw = cols[1].split(":")[0]
                    out.append(_addr(raw, width))
    return out


def _addr(raw: str, width: int) -> str:
    import ipaddress

    if width == 8:
        return str(ipaddress.IPv4Address(bytes.fromhex(raw)[::-1]))
    words = [bytes.fromhex(raw[i:i + 8])[::-1] for i in range(0, 32, 8)]
    v6 = ipaddress.IPv6Address(b"".join(words))
    return str(v6.ipv4_mapped or v6)  # gRPC binds 127.0.0.1 as ::ffff:127.0.0.1 on a dual-stack socket


def test_every_listener_binds_the_configured_host(cluster) -> None:
    procs = [cluster.cluster.router, *cluster.workers]
    bound = {h.worker_id: _listening(h.pid) for h in procs}
    assert all(bound.values()), bound
    stray = {w: [a for a in addrs if a != "127.0.0.1"] for w, addrs in bound.items()}
    assert not any(stray.values()), f"listeners outside 127.0.0.1: {stray}"
