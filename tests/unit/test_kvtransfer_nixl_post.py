"""How kvtransfer posts NIXL WRITEs: one WRITE per one-shot request (every layer), prepared descriptor
lists by index (and the unprepared fallback), streamed pushes joining one WRITE, the nixl_cu13 import
fallback, and the new settings' validation. Two agents in one process over UCX loopback; the
two-process / UCX_TLS=tcp checks of the same counter are in tests/integration/test_kvtransfer_twoproc.py.
"""

import asyncio
import sys
import types

import pytest
import torch
from kvtransfer_testkit import needs_nixl, run

from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import BackendUnavailable, TransportConfig, make_transport, nixl_backend

pytestmark = pytest.mark.timeout(90)


LAYOUT = KVLayout(num_layers=6, num_kv_heads=2, head_dim=16, block_size=8, dtype="bfloat16")




def same(dst, src, d, s):
    return torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8))


async def closed_clean(*ts):
    for t in ts:
        await t.close()
        s = t.stats()
        assert s == {k: 0 for k in s}, s


async def send(a, b, rid, src_ids, dst_ids, **kw):
    exp = b.expect(rid, dst_ids, timeout=20)
    res = await a.start_send(rid, b.endpoint(), src_ids, dst_ids, **kw).wait()
    await exp.wait()
    return res


@needs_nixl
@pytest.mark.parametrize("prepped,prebuild", [(True, True), (True, False), (False, True)],
                         ids=["prebuilt_per_layer", "prepped_one_write", "unprepped_one_write"])
def test_one_shot_multi_layer_send_posts_one_write_or_one_per_layer(prepped, prebuild):
    """Prebuilt (the default): one WRITE per layer, made before BEGIN_OK. Without it (or without prepared
    lists, where prebuilding is impossible) every layer of a one-shot send in ONE WRITE. The same
    descriptors either way: NIXL merges a run consecutive on both sides."""
    writes = LAYOUT.num_layers if prepped and prebuild else 1

    async def main():
        src, dst = LAYOUT.allocate(20), LAYOUT.allocate(32)
        fill_random(src, 11)
        a = await make_transport("nixl", LAYOUT, src, nixl_prepped=prepped, nixl_prebuild=prebuild).start()
        b = await make_transport("nixl", LAYOUT, dst, nixl_prepped=prepped).start()
        assert (a.nixl.prep_kind != "") is prepped
        # Scattered pairs plus one run consecutive on both sides (0-3 -> 10-13).
        plans = [([0, 1, 2, 3, 17, 5], [10, 11, 12, 13, 2, 30]), ([9], [31]),
                 (list(range(20)), list(range(20)))]
        for i, (s_ids, d_ids) in enumerate(plans):
            before = a.counters()
            res = await send(a, b, f"r{i}", s_ids, d_ids)
            after = a.counters()
            assert res["backend"] == "nixl"
            assert after["nixl_posted_xfers"] - before["nixl_posted_xfers"] == writes
            assert all(same(dst, src, d, s) for s, d in zip(s_ids, d_ids, strict=True))
        # Descriptors as NIXL posts them: a run consecutive on both sides is one per layer -- r0 has
        # 3 per layer (the run, then two singles); r2 (all 20 -> 0..19) one per layer.
        assert a.counters()["nixl_descs"] == 6 * 3 + 6 * 1 + 6 * 1
        if prepped:
            assert a.stats()["nixl_remote_dlists"] == 1
        await closed_clean(a, b)
    run(main())


@needs_nixl
def test_streamed_pushes_queued_together_join_one_write():
    """nixl_prebuild off (with it, every layer has its own WRITE, posted when pushed)."""
    async def main():
        src, dst = LAYOUT.allocate(8), LAYOUT.allocate(8)
        fill_random(src, 12)
        a = await make_transport("nixl", LAYOUT, src, nixl_prebuild=False).start()
        b = await make_transport("nixl", LAYOUT, dst).start()
        await send(a, b, "warm", [0], [0])  # connection + handshake out of the way
        # Pushed before the sender's task ran: one WRITE for all three ranges, carrying the notification.
        c0 = a.counters()["nixl_posted_xfers"]
        exp = b.expect("q", [3, 4], timeout=20)
        h = a.start_send("q", b.endpoint(), [1, 2], [3, 4], layers=[0, 1])
        h.push_layers([2, 3])
        h.push_layers([4, 5])
        h.finish()
        await h.wait()
        await exp.wait()
        assert a.counters()["nixl_posted_xfers"] - c0 == 1
        # Pushed after the first WRITE went out: a WRITE per push (layer-wise streaming still streams).
        c0 = a.counters()["nixl_posted_xfers"]
        exp = b.expect("s", [5], timeout=20)
        h = a.start_send("s", b.endpoint(), [6], [5], layers=[0, 1, 2])
        while a.counters()["nixl_posted_xfers"] == c0:
            await asyncio.sleep(0.001)
        h.push_layers([3, 4, 5])
        h.finish()
        await h.wait()
        await exp.wait()
        assert a.counters()["nixl_posted_xfers"] - c0 == 2
        assert all(same(dst, src, d, s) for s, d in ((1, 3), (2, 4), (6, 5)))
        await closed_clean(a, b)
    run(main())


@needs_nixl
@pytest.mark.parametrize("which", ["local", "remote"])
def test_failed_list_preparation_falls_back_to_per_request_descriptors(monkeypatch, which):
    cls = nixl_backend.NixlAgent
    real = cls._prep

    def flaky(self, agent, *args):
        if which == "local" or agent != "NIXL_INIT_AGENT":
            raise RuntimeError("simulated: no prepared lists in this NIXL")
        return real(self, agent, *args)
    monkeypatch.setattr(cls, "_prep", flaky)

    async def main():
        src, dst = LAYOUT.allocate(4), LAYOUT.allocate(4)
        fill_random(src, 13)
        a = await make_transport("nixl", LAYOUT, src).start()
        b = await make_transport("nixl", LAYOUT, dst).start()
        assert ("simulated" in a.nixl.prep_error) is (which == "local")
        res = await send(a, b, "r", [0, 1, 3], [2, 3, 0])
        assert res["backend"] == "nixl" and a.stats()["nixl_remote_dlists"] == 0
        assert not a.nixl.can_post_blocks(a._peers[next(iter(a._peers))].remote_agent)
        assert all(same(dst, src, d, s) for s, d in ((0, 2), (1, 3), (3, 0)))
        assert a.counters()["nixl_posted_xfers"] == 1
        await closed_clean(a, b)
    run(main())


def _fake_nixl(name):
    mod = types.ModuleType(name)

    class Agent:  # only identity matters: import_nixl hands the classes back
        pass

    mod.nixl_agent, mod.nixl_agent_config = Agent, object
    return mod


def test_import_falls_back_to_nixl_cu13_then_the_meta_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # None in sys.modules: ImportError on import
    cu13 = _fake_nixl("nixl_cu13")
    monkeypatch.setitem(sys.modules, "nixl_cu13", cu13)
    agent_cls, _conf, name = nixl_backend.import_nixl()
    assert (name, agent_cls) == ("nixl_cu13", cu13.nixl_agent)
    # cu13 missing too: the `nixl` meta-package's nixl._api.
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)
    api = _fake_nixl("nixl._api")
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    agent_cls, _conf, name = nixl_backend.import_nixl()
    assert (name, agent_cls) == ("nixl._api", api.nixl_agent)
    # None importable: one error naming every attempt.
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(BackendUnavailable, match=r"nixl_cu12: .*nixl_cu13: .*nixl\._api: "):
        nixl_backend.import_nixl()


def test_new_nixl_settings_are_validated():
    assert TransportConfig().nixl_prepped is True and TransportConfig().nixl_spin_s == 0  # no spinning
    assert TransportConfig(nixl_spin_s=0.002).nixl_spin_s == 0.002
    for bad in (-0.001, 11, "1"):
        with pytest.raises(ValueError, match="nixl_spin_s"):
            TransportConfig(nixl_spin_s=bad)


@needs_nixl
def test_receiver_poller_is_woken_by_the_transfer_not_its_idle_timer(monkeypatch):
    """With the idle poll period raised to 60 s, handshake and transfers still finish well inside the
    test's deadline: HELLO, PROBE and BEGIN wake the receiver's NIXL poller (before, an idle receiver
    finished its sleep first, up to 10 ms per transfer)."""
    from kvtransfer import rx_nixl
    monkeypatch.setattr(rx_nixl, "_IDLE_S", 60.0)

    async def main():
        src, dst = LAYOUT.allocate(4), LAYOUT.allocate(4)
        fill_random(src, 14)
        a = await make_transport("nixl", LAYOUT, src).start()
        b = await make_transport("nixl", LAYOUT, dst).start()
        await asyncio.sleep(0.05)  # both pollers now in their (60 s) idle wait
        for i in range(3):
            res = await asyncio.wait_for(send(a, b, f"w{i}", [i], [3 - i]), 20)
            assert res["backend"] == "nixl" and same(dst, src, 3 - i, i)
            await asyncio.sleep(0.02)  # idle again between transfers
        await closed_clean(a, b)
    run(main())
