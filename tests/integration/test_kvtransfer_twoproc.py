"""KV blocks between two OS processes, byte-exact, through TCP and NIXL (UCX default transports and
UCX_TLS=tcp, i.e. simulated RDMA). Both sides run in child processes (bench.kv_peer_proc) so each
gets its own UCX environment; the test compares sha256 digests of the source and destination blocks
and checks that every block outside the destination stayed zero. These tests never skip."""

import asyncio
import random

import pytest

from bench.kv_peers import PeerClient, PeerError
from engine.kv_layout import KVLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LAYOUTS = [
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32"),
    KVLayout(num_layers=5, num_kv_heads=4, head_dim=32, block_size=16, dtype="bfloat16"),
    KVLayout(num_layers=32, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16"),
]
RX_BLOCKS, TX_BLOCKS = 40, 24


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 220))


async def transfer(rx, tx, rtid, ttid, endpoint, rid, src, dst, layers=None, stream_rest=None):
    await rx.call("expect", tid=rtid, rid=rid, dst=dst, timeout=60)
    await tx.call("send", tid=ttid, rid=rid, endpoint=endpoint, src=src, dst=dst, layers=layers, timeout=60)
    if stream_rest is not None:
        await asyncio.sleep(0.02)
        await tx.call("push", tid=ttid, rid=rid, layers=stream_rest)
        await tx.call("finish", tid=ttid, rid=rid)
    sent, got = await asyncio.gather(tx.call("send_wait", tid=ttid, rid=rid),
                                     rx.call("wait", tid=rtid, rid=rid))
    return sent["result"], got["result"]


async def check_matrix(env, kinds):
    rx = await PeerClient.spawn(env=env)
    tx = await PeerClient.spawn(env=env)
    rng = random.Random(1234)
    try:
        for kind in kinds:
            for n, lay in enumerate(LAYOUTS):
                r = await rx.call("init", kind=kind, layout=lay.to_dict(), num_blocks=RX_BLOCKS)
                t = await tx.call("init", kind=kind, layout=lay.to_dict(), num_blocks=TX_BLOCKS)
                await tx.call("fill", tid=t["tid"], seed=n + 1)
                ep = r["endpoint"]
                # Scattered, non-contiguous ids, with one contiguous run so coalescing is exercised.
                src = rng.sample(range(20), 6) + [20, 21, 22]
                dst = rng.sample(range(RX_BLOCKS - 3), 6)
                dst += [b for b in (37, 38, 39)]
                c0 = (await tx.call("counters", tid=t["tid"]))["counters"]
                sent, got = await transfer(rx, tx, r["tid"], t["tid"], ep, f"{kind}-{n}", src, dst)
                assert sent["backend"] == got["backend"] == kind, (sent, got)
                c1 = (await tx.call("counters", tid=t["tid"]))["counters"]
                posted = c1["nixl_posted_xfers"] - c0["nixl_posted_xfers"]
                # A one-shot send: one NIXL WRITE per layer, made ahead (nixl_prebuild, the default);
                # TCP posts none.
                want = lay.num_layers if kind == "nixl" else 0
                assert posted == want, f"{kind}: {posted} WRITEs for one send"
                assert sent["bytes"] == got["bytes"] == lay.num_layers * len(dst) * lay.block_bytes
                # Several transfers in flight at once, one of them streamed layer by layer.
                free = [b for b in range(RX_BLOCKS) if b not in dst]
                jobs = [transfer(rx, tx, r["tid"], t["tid"], ep, f"{kind}-{n}-c{i}", [i], [free[i]])
                        for i in range(3)]
                jobs.append(transfer(rx, tx, r["tid"], t["tid"], ep, f"{kind}-{n}-stream", [5, 6], free[3:5],
                                     layers=[0], stream_rest=list(range(1, lay.num_layers))))
                await asyncio.gather(*jobs)
                all_src = src + [0, 1, 2, 5, 6]
                all_dst = dst + free[:5]
                want = await tx.call("digest", tid=t["tid"], blocks=all_src)
                have = await rx.call("digest", tid=r["tid"], blocks=all_dst)
                assert have["digest"] == want["digest"], f"{kind} {lay.describe()}: bytes differ"
                assert have["others_zero"], f"{kind} {lay.describe()}: blocks outside the destination written"
                for peer, tid in ((tx, t["tid"]), (rx, r["tid"])):
                    stats = (await peer.call("stats", tid=tid))["stats"]
                    assert stats["expectations"] == stats["sends"] == stats["nixl_xfers"] == 0, stats
                    closed = (await peer.call("close", tid=tid))["stats"]
                    assert all(v == 0 for v in closed.values()), closed
        if "tcp" in kinds:
            await check_mismatch(rx, tx)
    finally:
        await tx.close()
        await rx.close()


async def check_mismatch(rx, tx):
    """Different layouts (dtype) on the two processes: refused before anything is written, and the
    error names both sides' layout hashes."""
    lay = LAYOUTS[1]
    other = KVLayout(**{**lay.to_dict(), "dtype": "float16"})
    r = await rx.call("init", kind="tcp", layout=lay.to_dict(), num_blocks=8)
    t = await tx.call("init", kind="tcp", layout=other.to_dict(), num_blocks=8)
    await tx.call("fill", tid=t["tid"], seed=5)
    await rx.call("expect", tid=r["tid"], rid="mismatch", dst=[1, 2], timeout=30)
    ep = r["endpoint"]
    with pytest.raises(PeerError) as err:
        await tx.call("send", tid=t["tid"], rid="mismatch", endpoint=ep, src=[0, 1], dst=[1, 2])
    assert err.value.kind == "LayoutMismatch"
    assert lay.compat_hash() in str(err.value) and other.compat_hash() in str(err.value)
    # An endpoint lying about its hash gets past the sender's check; the receiver's HELLO refuses it.
    lying = {**ep, "layout_hash": other.compat_hash()}
    await tx.call("send", tid=t["tid"], rid="mismatch", endpoint=lying, src=[0, 1], dst=[1, 2])
    with pytest.raises(PeerError) as err:
        await tx.call("send_wait", tid=t["tid"], rid="mismatch")
    assert err.value.kind == "LayoutMismatch" and lay.compat_hash() in str(err.value)
    digest = await rx.call("digest", tid=r["tid"], blocks=[])
    assert digest["others_zero"], "a refused transfer wrote into the receiver's KV"
    await rx.call("abort", tid=r["tid"], rid="mismatch")
    for peer, tid in ((tx, t["tid"]), (rx, r["tid"])):
        closed = (await peer.call("close", tid=tid))["stats"]
        assert all(v == 0 for v in closed.values()), closed


def test_tcp_and_nixl_default_ucx_two_processes_and_layout_mismatch():
    run(check_matrix({"UCX_TLS": None}, ["tcp", "nixl"]))


def test_nixl_simulated_rdma_ucx_tls_tcp_two_processes():
    run(check_matrix({"UCX_TLS": "tcp"}, ["nixl"]))
