"""Per-rank KV transfer between tensor-parallel workers, in one process: every rank's ``RankAgent`` with real
kvtransfer transports on loopback, rank 0's ``RankedLink`` on each side. Each decode rank must end up with
exactly its KV heads of the source blocks (split, regrouped from pieces, or replicated), nothing else
written; every rank's transports hold nothing afterwards. One case drives the other ranks through their
KVRank gRPC services, as a worker's processes do, plaintext and under the cluster's mutual TLS."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from engine.kv_layout import KVLayout
from kvtransfer import LayoutMismatch, TransferError
from kvtransfer.ranks.agent import RankAgent
from kvtransfer.ranks.agent_thread import ThreadedAgent
from kvtransfer.ranks.control import RankClient, serve_agent
from kvtransfer.ranks.link import RankedLink
from kvtransfer.ranks.shape import WorkerShape, parse_endpoint, plan_pieces

pytestmark = pytest.mark.timeout(90)
L, HD, BS, NB = 2, 4, 4, 12
SRC, DST = [3, 5, 6, 0], [1, 2, 7, 11]


def base(k: int) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=k, head_dim=HD, block_size=BS, dtype="float32",
                    model_fingerprint="m")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 80))


async def worker(full: torch.Tensor | None, k: int, tp: int, source_tp: int = 0, *, remote: bool = False,
                 threaded: bool = False, tls: dict | None = None):
    """A worker's ranks over ``full`` (the whole model's cache; zeros if None): (link, agents, servers).
    ``threaded``: rank 0's agent on an event loop of its own thread, as a decode worker runs it.
    ``tls``: the control services' ``serve_agent`` / ``RankClient`` keywords (mutual TLS)."""
    shape = WorkerShape.receiving(num_kv_heads=k, tp=tp, source_tp=source_tp)
    whole = full if full is not None else base(k).allocate(NB)
    agents = []
    for r in range(tp):
        h0, h1 = shape.heads(r)

        async def make(r=r, h0=h0, h1=h1):
            agent = RankAgent(layout=base(k), shape=shape, rank=r, cache=whole[..., h0:h1, :].contiguous(),
                              kind="tcp", options={"listen_host": "127.0.0.1"}, staging_blocks=8)
            return await agent.start()

        if r == 0 and threaded:
            async def setup():
                return await make(), []

            local = await ThreadedAgent.start(setup, name="test-kv-rank0")
            agents.append(local)
        else:
            agents.append(await make())
    members, servers = list(agents), []
    agents = [a.agent if isinstance(a, ThreadedAgent) else a for a in agents]
    if remote:
        for r in range(1, tp):
            server, port = await serve_agent(agents[r], **(tls or {}))
            servers.append(server)
            members[r] = RankClient(r, f"127.0.0.1:{port}", **(tls or {}))
    link = RankedLink(ranks=members, layout=base(k), shape=shape, lease_s=20.0)
    link.set_rank_endpoints(*zip(*(a.endpoints() for a in agents), strict=True))
    return link, agents, servers


async def close(link, agents, servers) -> None:
    for a in agents:
        assert a.stats() == dict.fromkeys(a.stats(), 0), (a.rank, a.stats())
    await link.close()
    for a in agents[1:]:
        if isinstance(link.ranks[a.rank], RankClient):
            await a.close()
    for s in servers:
        await s.stop(0)


def expected_rank(full: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor:
    want = torch.zeros_like(full[..., heads[0]:heads[1], :])
    want[:, DST] = full[:, SRC][..., heads[0]:heads[1], :]
    return want


async def transfer(k: int, a: int, b: int, *, streamed: bool, source_tp: int = 0,
                   remote: bool = False, threaded: bool = False, tls: dict | None = None) -> None:
    full = base(k).allocate(NB).uniform_(-1, 1)
    p = await worker(full, k, a, remote=remote, threaded=threaded, tls=tls and {**tls, "identity": "prefill"})
    d = await worker(None, k, b, source_tp, remote=remote, threaded=threaded,
                     tls=tls and {**tls, "identity": "decode"})
    rid = "req-1"
    await d[0].expect(rid, DST)
    wait = asyncio.ensure_future(d[0].wait(rid))
    if streamed:
        handle = p[0].open_stream(d[0].endpoint(), rid, SRC, DST)
        for layer in range(L):
            handle.push_layers((layer,), final=layer == L - 1)
        nbytes, _ = await p[0].wait_sent(handle, d[0].endpoint())
    else:
        nbytes, _ = await p[0].send(d[0].endpoint(), rid, SRC, DST)
    info = await wait
    await d[0].release(rid)
    per_rank = base(k).block_bytes * L * len(DST) // min(b, k)
    assert info["bytes"] == per_rank * b and nbytes == info["bytes"]
    for agent in d[1]:
        assert torch.equal(agent.cache, expected_rank(full, agent.heads)), (k, a, b, agent.rank)
    await close(*p)
    await close(*d)


@pytest.mark.parametrize("k,a,b,source_tp", [
    (2, 1, 1, 0), (2, 2, 1, 2), (2, 1, 2, 0), (2, 2, 4, 0), (4, 4, 2, 4), (4, 1, 4, 0), (2, 4, 1, 4),
    (4, 1, 2, 2),  # a decode worker set up for TP-2 senders also takes a TP-1 sender (staged pieces)
], ids=["1to1", "2to1", "1to2", "2to4-replicated", "4to2", "1to4", "4replicated-to1", "1to2-in-pieces"])
@pytest.mark.parametrize("streamed", [False, True], ids=["one-piece", "streamed"])
def test_heads_land_on_the_ranks_that_own_them(k, a, b, source_tp, streamed) -> None:
    run(transfer(k, a, b, streamed=streamed, source_tp=source_tp))


@pytest.mark.parametrize("streamed", [False, True], ids=["one-piece", "streamed"])
def test_rank_0_on_a_loop_of_its_own_thread_moves_the_same_bytes(streamed) -> None:
    """Rank 0's agent on its own thread's loop (``--kv-own-loop``) on both sides, beside followers on the
    caller's: the same heads land, every call crosses to the agent's loop and back, nothing is left
    behind and the thread ends at close."""
    import threading

    before = {t.name for t in threading.enumerate()}
    run(transfer(2, 1, 1, streamed=streamed, threaded=True))
    run(transfer(4, 2, 2, streamed=streamed, source_tp=2, threaded=True))
    assert not {t.name for t in threading.enumerate()} - before


async def _threaded_wait_cancelled() -> None:
    """The decode worker's KV wait cancelled (the Decode RPC went away) while rank 0's agent lives on its
    own loop: the wait is cancelled there too, the request aborted on every rank, and a release after it
    leaves nothing behind."""
    k = 2
    d = await worker(None, k, 2, threaded=True)
    await d[0].expect("r", DST)
    wait = asyncio.ensure_future(d[0].wait("r"))
    await asyncio.sleep(0.05)
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wait
    await d[0].release("r")
    assert await d[0].ranks[0].stats() == dict.fromkeys(d[1][0].stats(), 0)
    await close(*d)


def test_a_cancelled_wait_on_a_threaded_rank_0_aborts_it_on_every_rank() -> None:
    run(_threaded_wait_cancelled())


@pytest.fixture(scope="module")
def cluster_tls(tmp_path_factory):
    from pdserve.app.certs import init_certs
    from pdserve.tls import TlsDir

    d = tmp_path_factory.mktemp("tls")
    init_certs(d, names=("prefill", "decode"), days=2)
    return TlsDir(d)


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "mutual-tls"])
def test_other_ranks_driven_through_their_control_services(secure, request) -> None:
    tls = {"tls": request.getfixturevalue("cluster_tls")} if secure else None
    run(transfer(4, 2, 4, streamed=True, remote=True, tls=tls))
    run(transfer(2, 2, 1, streamed=False, source_tp=2, remote=True, tls=tls))


def test_plan_names_both_shapes_when_it_cannot_bridge() -> None:
    lay = base(4)
    dest = parse_endpoint({"protocol": "pdkv-tp"} | json.loads(json.dumps(_fake_endpoint(lay, tp=1))))
    with pytest.raises(LayoutMismatch, match=r"receiver TP 1, KV heads \[0,4\).*sender TP 2, KV heads "
                                             r"\[0,2\) \[2,4\).*--kv-source-tp 2"):
        plan_pieces(WorkerShape(num_kv_heads=4, tp=2), lay, dest)
    other = KVLayout(**{**lay.to_dict(), "model_fingerprint": "other"})
    with pytest.raises(LayoutMismatch, match="KV layout mismatch: receiver TP 1.*model=m.*"
                                             "sender TP 1.*model=other"):
        plan_pieces(WorkerShape(num_kv_heads=4, tp=1), other, dest)
    pieces = plan_pieces(WorkerShape(num_kv_heads=4, tp=2), lay,
                         parse_endpoint(_fake_endpoint(lay, tp=1, source_tp=2)))
    assert [(p.src, p.dst, p.heads, p.j) for p in pieces] == [(0, 0, (0, 2), 0), (1, 0, (2, 4), 1)]
    replicas = plan_pieces(WorkerShape(num_kv_heads=2, tp=4), base(2),
                           parse_endpoint(_fake_endpoint(base(2), tp=2)))
    assert [(p.src, p.dst) for p in replicas] == [(0, 0), (3, 1)]  # replicas share the senders' load


def _fake_endpoint(lay: KVLayout, *, tp: int, source_tp: int = 0) -> dict:
    from kvtransfer.ranks.shape import build_endpoint

    shape = WorkerShape.receiving(num_kv_heads=lay.num_kv_heads, tp=tp, source_tp=source_tp)
    ep = {"protocol": "pdkv", "host": "127.0.0.1", "port": 1}
    return build_endpoint(lay, shape, [ep] * tp, [ep if shape.pieces_per_rank > 1 else None] * tp)


def test_a_tampered_endpoint_is_refused() -> None:
    from kvtransfer import InvalidTransfer

    ep = _fake_endpoint(base(4), tp=2)
    ep["ranks"][1]["heads"] = [0, 2]
    with pytest.raises(InvalidTransfer, match="rank 1 holds heads"):
        parse_endpoint(ep)
    ep = _fake_endpoint(base(4), tp=2)
    ep["tp"] = 1
    with pytest.raises(InvalidTransfer):
        parse_endpoint(ep)


async def _abort_mid_stream() -> None:
    k = 2
    full = base(k).allocate(NB).uniform_(-1, 1)
    p = await worker(full, k, 1)
    d = await worker(None, k, 2, remote=True)
    await d[0].expect("r", DST)
    wait = asyncio.ensure_future(d[0].wait("r"))
    handle = p[0].open_stream(d[0].endpoint(), "r", SRC, DST)
    handle.push_layers((0,))
    await handle.abort("prefill cancelled")
    assert handle.done()
    # The receiver learns it from the sender (ABORT) when BEGIN went out, else from the router's Release.
    await d[0].release("r")
    with pytest.raises(TransferError):
        await wait
    await close(*p)
    await close(*d)


def test_abort_mid_stream_releases_every_rank() -> None:
    run(_abort_mid_stream())


async def _cut_sends_leave_no_unretrieved_task() -> None:
    """An aborted send (the prefill cancelled, the receiver released) ends every rank's waits: none
    is left holding an exception nobody reads ("Task exception was never retrieved")."""
    import gc

    loop = asyncio.get_running_loop()
    unretrieved = []
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context.get("message")))
    k = 2
    full = base(k).allocate(NB).uniform_(-1, 1)
    p = await worker(full, k, 1)
    d = await worker(None, k, 1)
    for rid, streamed in (("one-piece", False), ("streamed", True)):
        await d[0].expect(rid, DST)
        wait = asyncio.ensure_future(d[0].wait(rid))
        handle = p[0].open_stream(d[0].endpoint(), rid, SRC, DST) if streamed else None
        if handle is None:
            send = asyncio.ensure_future(p[0].send(d[0].endpoint(), rid, SRC, DST))
            await asyncio.sleep(0)
            send.cancel()  # the prefill was cancelled while its KV was on the way
            with pytest.raises(asyncio.CancelledError):
                await send
        else:
            handle.push_layers((0,))
            await handle.abort("prefill cancelled")
        await d[0].release(rid)
        with pytest.raises((TransferError, asyncio.CancelledError)):
            await wait
    await close(*p)
    await close(*d)
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []


def test_cut_sends_leave_no_unretrieved_task() -> None:
    run(_cut_sends_leave_no_unretrieved_task())
