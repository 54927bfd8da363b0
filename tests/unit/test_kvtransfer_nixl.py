"""kvtransfer's NIXL backend in one process (two agents over UCX loopback), auto selection and fallback.

The two-process / UCX_TLS=tcp / network-namespace cases are in tests/integration."""

import asyncio
import logging

import pytest
import torch
from kvtransfer_testkit import leak_free, needs_nixl, run

from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import (
    BackendUnavailable,
    InvalidTransfer,
    PeerUnavailable,
    TransferAborted,
    make_transport,
    nixl_backend,
)

pytestmark = pytest.mark.timeout(90)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")




def same(dst, src, d, s):
    return torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8))


@needs_nixl
@pytest.mark.parametrize("cfg", [{}, {"nixl_poll_nap": True, "nixl_poll_interval_s": 5e-5}],
                         ids=["asyncio_sleep", "poll_nap"])
def test_nixl_write_streaming_concurrency_and_abort(cfg):
    async def main():
        src, dst = LAYOUT.allocate(16), LAYOUT.allocate(24)
        fill_random(src, 3)
        a = await make_transport("auto", LAYOUT, src, **cfg).start()
        b = await make_transport("nixl", LAYOUT, dst, **cfg).start()
        ep = b.endpoint()
        assert ep["backends"] == ["nixl"] and ep["nixl_agent"]
        # One-shot, scattered ids: coalesced runs (0-2 -> 5-7) plus singles.
        s_ids, d_ids = [0, 1, 2, 9, 4], [5, 6, 7, 20, 1]
        exp = b.expect("one", d_ids, timeout=20)
        res = await a.start_send("one", ep, s_ids, d_ids).wait()
        assert res["backend"] == "nixl" and a.peer_backend(ep) == "nixl"
        assert (await exp.wait())["backend"] == "nixl"
        assert all(same(dst, src, d, s) for s, d in zip(s_ids, d_ids, strict=True))
        # Several in flight, layer-wise streaming.
        plans = {f"s{i}": ([10 + i], [10 + i]) for i in range(4)}
        exps = {rid: b.expect(rid, d, timeout=20) for rid, (_s, d) in plans.items()}
        hs = {rid: a.start_send(rid, ep, s, d, layers=[0, 1]) for rid, (s, d) in plans.items()}
        await asyncio.sleep(0.05)
        assert not any(e.done() for e in exps.values())
        for h in hs.values():
            h.push_layers([2, 3])
            h.finish()
        await asyncio.gather(*(h.wait() for h in hs.values()), *(e.wait() for e in exps.values()))
        assert all(same(dst, src, d[0], s[0]) for s, d in plans.values())
        # Receiver-side check of BEGIN: blocks that were not reserved -> refused, nothing written.
        exp = b.expect("bad", [2], timeout=20)
        with pytest.raises(InvalidTransfer, match="not reserved"):
            await a.start_send("bad", ep, [3], [3]).wait()
        assert not dst[:, 2:5].view(torch.uint8).any()
        with pytest.raises(InvalidTransfer):
            await exp.wait()
        # Receiver abort mid-stream is confirmed by the sender once its WRITEs are settled.
        exp = b.expect("ab", [0], timeout=20)
        h = a.start_send("ab", ep, [8], [0], layers=[0])
        while exp.state != "receiving":
            await asyncio.sleep(0.005)
        assert await b.abort("ab", "decode gave up") is True
        with pytest.raises(TransferAborted, match="decode gave up"):
            await h.wait()
        assert a.stats()["nixl_remote_agents"] == 1
        await leak_free(a, b)
    run(main())


@needs_nixl
def test_auto_falls_back_to_tcp_when_the_nixl_handshake_fails(monkeypatch, caplog):
    async def main(kind):
        src, dst = LAYOUT.allocate(4), LAYOUT.allocate(4)
        fill_random(src, 5)
        a = await make_transport(kind, LAYOUT, src).start()
        b = await make_transport("auto", LAYOUT, dst).start()

        def broken(info):
            raise PeerUnavailable("simulated: UCX cannot reach the peer")
        monkeypatch.setattr(a.nixl, "add_remote", broken)
        exp = b.expect("r", [3], timeout=20)
        h = a.start_send("r", b.endpoint(), [1], [3])
        try:
            res = await h.wait()
            await exp.wait()
            assert same(dst, src, 3, 1)
            return res["backend"]
        finally:
            b.release("r")
            await leak_free(a, b)

    with caplog.at_level(logging.INFO, logger="kvtransfer"):
        assert run(main("auto")) == "tcp"
    assert "NIXL handshake failed" in caplog.text and "simulated: UCX cannot reach" in caplog.text
    with pytest.raises(BackendUnavailable, match="NIXL handshake .* failed"):
        run(main("nixl"))


def test_auto_uses_tcp_when_nixl_does_not_import(monkeypatch, caplog):
    def no_nixl():
        raise BackendUnavailable("NIXL is not importable (nixl_cu12: ImportError: simulated)")
    monkeypatch.setattr(nixl_backend, "import_nixl", no_nixl)
    kv = LAYOUT.allocate(2)
    with pytest.raises(BackendUnavailable, match="simulated"):
        make_transport("nixl", LAYOUT, kv)

    async def main():
        with caplog.at_level(logging.INFO, logger="kvtransfer"):
            a = await make_transport("auto", LAYOUT, kv).start()
            b = await make_transport("tcp", LAYOUT, LAYOUT.allocate(2)).start()
        assert a.backends == ("tcp",)
        b.expect("r", [0], timeout=10)
        assert (await a.start_send("r", b.endpoint(), [1], [0]).wait())["backend"] == "tcp"
        await leak_free(a, b)
    run(main())
    assert "NIXL unavailable, using TCP only" in caplog.text


@pytest.mark.parametrize("kind", ["tcp", pytest.param("nixl", marks=needs_nixl)])
def test_nothing_to_send_still_signals_completion(kind):
    """Every block cached on the decode side: the transfer carries no bytes but still completes."""
    async def main():
        a = await make_transport(kind, LAYOUT, LAYOUT.allocate(2)).start()
        b = await make_transport(kind, LAYOUT, LAYOUT.allocate(2)).start()
        exp = b.expect("empty", [], timeout=20)
        res = await a.start_send("empty", b.endpoint(), [], []).wait()
        assert res["bytes"] == 0 and (await exp.wait())["backend"] == kind
        await leak_free(a, b)
    run(main())


@pytest.mark.parametrize("kind", ["tcp", pytest.param("nixl", marks=needs_nixl)])
def test_begun_then_every_layer_in_one_push(kind):
    """SendHandle.begun(): a send opened with no layer is open at the receiver (NIXL: BEGIN_OK; TCP: BEGIN
    written) before anything is pushed; then every layer at once with final=True arrives byte-exact. A
    BEGIN the receiver refuses fails begun() on NIXL; on TCP (not acknowledged) it fails the send."""
    async def main():
        src, dst = LAYOUT.allocate(8), LAYOUT.allocate(8)
        fill_random(src, 9)
        a = await make_transport(kind, LAYOUT, src).start()
        b = await make_transport(kind, LAYOUT, dst).start()
        ep = b.endpoint()
        s_ids, d_ids = [1, 2, 3], [4, 5, 6]
        exp = b.expect("pre", d_ids, timeout=20)
        h = a.start_send("pre", ep, s_ids, d_ids, layers=())
        await h.begun()
        assert ("begin_ok" if kind == "nixl" else "begin_sent") in h.timeline
        assert not h.done() and not exp.done() and "posted" not in h.timeline
        if kind == "nixl":
            assert exp.state == "receiving"  # BEGIN_OK is sent once the receiver accepted BEGIN
        await h.begun()  # idempotent
        h.push_layers(range(LAYOUT.num_layers), final=True)
        res = await h.wait()
        assert res["backend"] == kind and (await exp.wait())["bytes"] == res["bytes"]
        assert all(same(dst, src, d, s) for s, d in zip(s_ids, d_ids, strict=True))
        bad = b.expect("bad", [0], timeout=20)
        h = a.start_send("bad", ep, [7], [7], layers=())  # block 7 was not reserved for "bad"
        if kind == "nixl":
            with pytest.raises(InvalidTransfer, match="not reserved"):
                await h.begun()
        else:
            await h.begun()
        with pytest.raises(InvalidTransfer):
            await h.wait()
        with pytest.raises(InvalidTransfer):
            await bad.wait()
        assert not dst[:, 7].view(torch.uint8).any()
        await leak_free(a, b)
    run(main())
