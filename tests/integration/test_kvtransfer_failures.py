"""Killing the peer process mid-transfer (SIGKILL): the survivor gets PeerUnavailable -- not a timeout --
and holds nothing for the request afterwards (no expectation, send, peer, NIXL transfer or remote agent).
The survivor is this test process; the victim is a bench.kv_peer_proc child. TCP and NIXL in one go."""

import asyncio

import pytest
import torch

from bench.kv_peer_proc import fill_random
from bench.kv_peers import PeerClient
from engine.kv_layout import KVLayout
from kvtransfer import PeerUnavailable, make_transport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16")
KINDS = ("tcp", "nixl")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 150))


async def until(cond, what, timeout=30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_sender_killed_mid_transfer_receiver_fails_fast_and_holds_nothing():
    async def main():
        dsts = {k: LAYOUT.allocate(8) for k in KINDS}
        rxs = {k: await make_transport(k, LAYOUT, dsts[k]).start() for k in KINDS}
        victim = await PeerClient.spawn(env={"UCX_TLS": None})
        try:
            exps = {}
            for k in KINDS:
                t = await victim.call("init", kind=k, layout=LAYOUT.to_dict(), num_blocks=8)
                await victim.call("fill", tid=t["tid"], seed=3)
                exps[k] = rxs[k].expect(f"kill-{k}", [1, 2, 3], timeout=90)
                # Stream only the first half of the layers: the transfer stays open.
                await victim.call("send", tid=t["tid"], rid=f"kill-{k}", endpoint=rxs[k].endpoint(),
                                  src=[0, 1, 2], dst=[1, 2, 3], layers=[0, 1], timeout=90)
            await until(lambda: all(e.state == "receiving" for e in exps.values()), "both transfers to begin")
            await until(lambda: exps["tcp"].received > 0, "TCP bytes to arrive")
            victim.kill()
            for k in KINDS:
                with pytest.raises(PeerUnavailable, match="disconnected mid-transfer"):
                    await exps[k].wait()
            for k in KINDS:
                await until(lambda k=k: rxs[k].stats()["rx_connections"] == 0, "the dead connection to go")
                assert rxs[k].stats() == {key: 0 for key in rxs[k].stats()}, rxs[k].stats()
            # The survivor keeps serving: a new sender fills the same blocks.
            for k in KINDS:
                src = LAYOUT.allocate(4)
                fill_random(src, 9)
                async with make_transport(k, LAYOUT, src) as tx:
                    exp = rxs[k].expect(f"again-{k}", [1, 2, 3], timeout=60)
                    await tx.start_send(f"again-{k}", rxs[k].endpoint(), [0, 1, 2], [1, 2, 3]).wait()
                    await exp.wait()
                    assert torch.equal(dsts[k][:, 1:4].view(torch.uint8), src[:, 0:3].view(torch.uint8))
        finally:
            victim.kill()
            await victim.close()
            for rx in rxs.values():
                await rx.close()
    run(main())


def test_receiver_killed_mid_transfer_sender_fails_fast_and_holds_nothing():
    async def main():
        srcs = {k: LAYOUT.allocate(8) for k in KINDS}
        txs = {}
        for k in KINDS:
            fill_random(srcs[k], 4)
            txs[k] = await make_transport(k, LAYOUT, srcs[k]).start()
        victim = await PeerClient.spawn(env={"UCX_TLS": None})
        try:
            handles = {}
            for k in KINDS:
                r = await victim.call("init", kind=k, layout=LAYOUT.to_dict(), num_blocks=8)
                await victim.call("expect", tid=r["tid"], rid=f"kill-{k}", dst=[4, 5], timeout=90)
                handles[k] = txs[k].start_send(f"kill-{k}", r["endpoint"], [6, 7], [4, 5], layers=[0, 1],
                                               timeout=90)
            await until(lambda: all(h.state == "sending" for h in handles.values()),
                        "both transfers to begin")
            await until(lambda: handles["nixl"].begin_ok.done(), "the NIXL receiver to accept BEGIN")
            await asyncio.sleep(0.05)  # the first layers' frames / WRITE are out
            eps = {k: handles[k].endpoint for k in KINDS}
            victim.kill()
            for k in KINDS:
                with pytest.raises(PeerUnavailable):
                    await handles[k].wait()
            for k in KINDS:
                assert txs[k].stats() == {key: 0 for key in txs[k].stats()}, (k, txs[k].stats())
                # Sending to the dead endpoint again fails fast too (connection refused), still leak-free.
                with pytest.raises(PeerUnavailable):
                    await txs[k].start_send("again", eps[k], [0], [0], timeout=30).wait()
                assert txs[k].stats() == {key: 0 for key in txs[k].stats()}, (k, txs[k].stats())
        finally:
            victim.kill()
            await victim.close()
            for tx in txs.values():
                await tx.close()
    run(main())
