"""The KVRank control service of a tensor-parallel worker under the cluster's mutual TLS (``--tls-dir``).

Rank 0 drives the other ranks' KV agents over ``pdserve.v1.KVRank`` on 127.0.0.1
(kvtransfer/ranks/control.py). With a TLS directory that service admits only clients presenting a
certificate of the cluster CA: a plaintext client, one without a certificate and one whose certificate
comes from another CA are refused in the handshake (UNAVAILABLE), and the agent behind it never sees a
call. The TLS directory reaches every rank in ``KVRankConfig`` (through its JSON on the rank's command
line); a TP-2 prefill worker then sends to a TP-2 decode worker, each built the way a worker's processes
build it (rank 0: ``make_rank_link``; rank 1: ``_serve_kv_rank``), every control call and the KV plane over
mutual TLS, byte-exact. Leak checks after each: every rank's agent holds nothing, every thread is gone."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from types import SimpleNamespace

import grpc
import pytest
import torch
import torch.distributed as dist

from engine.kv_layout import KVLayout
from kvtransfer import PeerUnavailable
from kvtransfer.ranks.agent import RankAgent
from kvtransfer.ranks.control import RankClient, serve_agent
from kvtransfer.ranks.shape import WorkerShape
from pdserve.app.certs import init_certs
from pdserve.app.tp_ranks import KVRankConfig, TPRanks, _serve_kv_rank, make_rank_link
from pdserve.settings import ServeSettings
from pdserve.tls import TlsDir
from pdserve.v1 import kvrank_pb2 as pb
from pdserve.v1 import kvrank_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)
L, HD, BS, NB = 2, 4, 4, 12
SRC, DST = [3, 5, 6, 0], [1, 2, 7, 11]
REFUSED = grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cluster = tmp_path_factory.mktemp("cluster")
    stranger = tmp_path_factory.mktemp("stranger")
    init_certs(cluster, names=("prefill", "decode"), days=2)
    init_certs(stranger, names=("prefill", "decode"), days=2)
    return TlsDir(cluster), TlsDir(stranger)


def layout(k: int) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=k, head_dim=HD, block_size=BS, dtype="float32",
                    model_fingerprint="m")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 100))


def _foreign(stranger: TlsDir, cluster: TlsDir) -> TlsDir:
    """Another CA's identity, trusting the cluster's CA to verify the server (so only the client
    certificate is wrong)."""
    class Mixed(TlsDir):
        def ca(self) -> bytes:
            return cluster.ca()
    return Mixed(stranger.path)


async def _stats_code(address: str, **kw) -> grpc.StatusCode:
    """KVRank.Stats through a channel of these TLS keywords (none: plaintext)."""
    from pdserve.tls import open_channel

    async with open_channel(address, aio=True, **kw) as ch:
        try:
            await pb_grpc.KVRankStub(ch).Stats(pb.RankStatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _expect_code(address: str, **kw) -> grpc.StatusCode:
    """KVRank.Expect (a call that would change the agent) through such a channel."""
    from pdserve.tls import open_channel

    async with open_channel(address, aio=True, **kw) as ch:
        try:
            await pb_grpc.KVRankStub(ch).Expect(pb.RankExpectRequest(request_id="x", block_ids=[1],
                                                                     timeout_s=5), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _refuses_outsiders(address: str, cluster: TlsDir, stranger: TlsDir, role: str) -> None:
    assert await _stats_code(address, tls=cluster, identity=role, server_role=role) == grpc.StatusCode.OK
    assert await _stats_code(address, tls=None) == REFUSED                                      # plaintext
    assert await _expect_code(address, tls=None) == REFUSED
    assert await _stats_code(address, tls=cluster, identity=None, server_role=role) == REFUSED  # no cert
    foreign = _foreign(stranger, cluster)
    assert await _stats_code(address, tls=foreign, identity=role, server_role=role) == REFUSED  # other CA
    assert await _expect_code(address, tls=foreign, identity=role, server_role=role) == REFUSED


# ---- the service ------------------------------------------------------------------------------------


async def _service_refuses(cluster: TlsDir, stranger: TlsDir) -> None:
    shape = WorkerShape.receiving(num_kv_heads=2, tp=2)
    agent = await RankAgent(layout=layout(2), shape=shape, rank=1, cache=layout(1).allocate(NB), kind="tcp",
                            options={"listen_host": "127.0.0.1"}).start()
    server, port = await serve_agent(agent, tls=cluster, identity="decode")
    address = f"127.0.0.1:{port}"
    try:
        await _refuses_outsiders(address, cluster, stranger, "decode")
        # rank 0's client without the cluster's TLS is refused too, as kvtransfer's PeerUnavailable
        plain = RankClient(1, address)
        with pytest.raises(PeerUnavailable):
            await plain.stats()
        await plain.close()
        member = RankClient(1, address, tls=cluster, identity="decode")
        await member.expect("r", [1, 2], 5.0)
        assert (await member.stats())["expecting"] == 1
        await member.release("r")
        await member.close()
        assert agent.stats() == dict.fromkeys(agent.stats(), 0)  # the refused Expects never reached it
    finally:
        await server.stop(0)
        await agent.close()
    assert agent.stats() == dict.fromkeys(agent.stats(), 0)


def test_rank_control_service_refuses_plaintext_and_other_cas(dirs) -> None:
    before = {t.name for t in threading.enumerate()}
    run(_service_refuses(*dirs))
    assert not {t.name for t in threading.enumerate()} - before


def test_tls_needs_an_identity(dirs) -> None:
    cluster, _ = dirs
    with pytest.raises(ValueError, match="identity"):
        RankClient(1, "127.0.0.1:1", tls=cluster)
    with pytest.raises(ValueError, match="go together"):
        KVRankConfig(tls_dir=str(cluster.path))


# ---- the config every rank gets -------------------------------------------------------------------------


def settings(role: str, tls_dir: str | None) -> ServeSettings:
    return ServeSettings(role=role, model="m", host="127.0.0.1", transport="tcp", tls_dir=tls_dir,
                         kv_tls_procs=0, lease_ms=20_000)


def test_the_tls_dir_reaches_every_rank_in_its_config(dirs) -> None:
    cluster, _ = dirs
    kv = KVRankConfig.from_settings(settings("decode", str(cluster.path)))
    assert (kv.tls_dir, kv.tls_identity) == (str(cluster.path), "decode")
    # what start_ranks puts on a rank's command line and the rank's main reads back
    child = KVRankConfig(**json.loads(json.dumps(dataclasses.asdict(kv))))
    assert child == kv
    assert child.control_tls()["identity"] == "decode" and child.control_tls()["tls"].path == cluster.path
    plain = KVRankConfig.from_settings(settings("prefill", None))
    assert (plain.tls_dir, plain.tls_identity, plain.control_tls()) == ("", "", {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        kv.tls_dir = ""


# ---- a TP worker's KV path over it ------------------------------------------------------------------------


class _Worker:
    """A TP-2 worker built as its processes build it: rank 1's agent and control service by
    ``_serve_kv_rank`` (a child rank's code, here on a thread of the test), rank 0's link by
    ``make_rank_link``, which reads rank 1's control address from the rendezvous store."""

    def __init__(self, role: str, tls_dir: str, full: torch.Tensor) -> None:
        self.settings = settings(role, tls_dir)
        self.kv = KVRankConfig.from_settings(self.settings)
        self.shape = WorkerShape.receiving(num_kv_heads=full.shape[4], tp=2)
        self.caches = [full[..., h0:h1, :].contiguous() for h0, h1 in map(self.shape.heads, range(2))]
        self.store = dist.HashStore()
        lay = layout(full.shape[4])
        follower = SimpleNamespace(kv_layout=lay, kv_cache=self.caches[1])
        self.stop_rank1 = _serve_kv_rank(follower, SimpleNamespace(rank=1, size=2), self.kv, self.store)
        self.ranks = TPRanks(group=SimpleNamespace(size=2), procs=[], store=self.store)
        self.engine = SimpleNamespace(kv_layout=lay, kv_cache=self.caches[0], tp_ranks=self.ranks)
        self.link = None

    async def start(self) -> _Worker:
        self.link = await make_rank_link(self.settings, self.engine)
        assert [type(r).__name__ for r in self.link.ranks] == ["RankAgent", "RankClient"]
        return self

    def control(self) -> str:
        return self.ranks.kv_agent_info(1)["control"]

    async def close(self) -> None:
        for counts in await self.link.rank_stats():  # every rank asked over its control service
            assert counts == dict.fromkeys(counts, 0), counts
        await self.link.close()
        await asyncio.to_thread(self.stop_rank1)


async def _tp_kv_over_tls(cluster: TlsDir, stranger: TlsDir, streamed: bool) -> None:
    k = 2
    full = layout(k).allocate(NB).uniform_(-1, 1)
    p = await (await asyncio.to_thread(_Worker, "prefill", str(cluster.path), full)).start()
    d = await (await asyncio.to_thread(_Worker, "decode", str(cluster.path), layout(k).allocate(NB))).start()
    try:
        await _refuses_outsiders(d.control(), cluster, stranger, "decode")
        await _refuses_outsiders(p.control(), cluster, stranger, "prefill")
        rid = "req-1"
        await d.link.expect(rid, DST)
        wait = asyncio.ensure_future(d.link.wait(rid))
        if streamed:
            handle = p.link.open_stream(d.link.endpoint(), rid, SRC, DST)
            for layer in range(L):
                handle.push_layers((layer,), final=layer == L - 1)
            nbytes, backend = await p.link.wait_sent(handle, d.link.endpoint())
        else:
            nbytes, backend = await p.link.send(d.link.endpoint(), rid, SRC, DST)
        info = await wait
        await d.link.release(rid)
        assert backend == "tcp" and nbytes == info["bytes"] == layout(k).block_bytes * L * len(DST)
        for r, cache in enumerate(d.caches):
            h0, h1 = d.shape.heads(r)
            want = torch.zeros_like(cache)
            want[:, DST] = full[:, SRC][..., h0:h1, :]
            assert torch.equal(cache, want), r
    finally:
        await p.close()
        await d.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["one-piece", "streamed"])
def test_a_tp_workers_kv_moves_over_its_tls_control_service(dirs, streamed) -> None:
    before = {t.name for t in threading.enumerate()}
    run(_tp_kv_over_tls(*dirs, streamed))
    assert not {t.name for t in threading.enumerate()} - before
