"""Router state pieces on their own: prefix index, session table, worker view, link stats, memory store."""

from __future__ import annotations

import asyncio

import pytest
from fake_clock import Clock

from engine.prefix_hash import block_hashes
from router.costs import LinkStats
from router.placement import WorkerInfo, WorkerLoad
from router.state import InMemoryStore, make_store
from router.state.prefix_index import PrefixIndex
from router.state.sessions import SessionBinding, SessionTable
from router.state.store import load_from_json, load_to_json, worker_from_json, worker_to_json
from router.state.workers import WorkerView


def test_prefix_index_matches_leading_blocks_per_worker():
    a = block_hashes(list(range(160)), 16)  # 10 blocks
    b = block_hashes(list(range(96)) + [7] * 64, 16)  # shares the first 6 blocks with a
    idx = PrefixIndex(capacity=100)
    idx.add("w1", a)
    idx.add("w2", a[:4])
    idx.add("w3", b)
    assert idx.match(a) == {"w1": 10, "w2": 4, "w3": 6}
    assert idx.match(a, limit=5) == {"w1": 5, "w2": 4, "w3": 5}
    assert idx.match(block_hashes([9] * 32, 16)) == {}
    assert idx.match([]) == {}
    idx.remove("w1", a[3:])
    assert idx.match(a)["w1"] == 3
    idx.drop("w3")
    assert "w3" not in idx.match(b) and idx.blocks_of("w3") == 0
    assert len(idx) == 3 + 4


def test_prefix_index_is_bounded_lru_per_worker():
    idx = PrefixIndex(capacity=8)
    old = block_hashes(list(range(64)), 16)  # 4 blocks
    new = block_hashes(list(range(1000, 1128)), 16)  # 8 blocks
    idx.add("w", old)
    idx.touch("w", old)
    idx.add("w", new)
    assert idx.blocks_of("w") == 8
    assert idx.match(old) == {} and idx.match(new) == {"w": 8}
    # Evicted hashes leave no dangling holder entries behind.
    assert all(idx._holders.get(h) is None for h in old)
    idx.drop("w")
    assert idx._holders == {} and len(idx) == 0


def test_session_table_ttl_and_size_bound():
    clock = Clock()
    t = SessionTable(max_sessions=2, clock=clock)

    def bind(exp):
        return SessionBinding(prefill_id="p", prefill_incarnation="1", decode_id="d", decode_incarnation="1",
                              expires_at=exp)
    t.put("a", bind(110))
    t.put("b", bind(200))
    t.put("c", bind(200))
    assert t.get("a") is None and len(t) == 2  # evicted by the size bound
    clock.t = 250
    assert t.get("b") is None
    assert t.purge_expired() == 1 and len(t) == 0
    raw = bind(5.5).to_json()
    assert SessionBinding.from_json(raw) == bind(5.5)


def test_worker_view_fencing_health_and_loads():
    clock = Clock()
    v = WorkerView(unhealthy_cooldown_s=2.0, load_stale_s=5.0, clock=clock, wall=clock)
    w = [WorkerInfo("p", "prefill", "a:1", "i1"), WorkerInfo("d", "decode", "b:1", "i1")]
    ch = v.update(w)
    assert ch.added == {"p", "d"} and not ch.removed
    rep = WorkerLoad(queue_depth=3, num_running=1, free_blocks=1, total_blocks=4, incarnation="i1")
    assert v.set_load("d", rep)
    assert v.load_of("d") == 4
    assert not v.set_load("d", WorkerLoad(queue_depth=9, incarnation="i0"))  # stale incarnation
    assert not v.set_load("ghost", WorkerLoad())
    clock.t += 6
    assert v.load_of("d") == 0  # report too old
    v.begin("r1", None, "d", 0)
    v.begin("r2", None, "d", 0)
    assert v.load_of("d") == 2
    # a report counting our two requests adds nothing; once they end, it no longer counts them
    assert v.set_load("d", WorkerLoad(queue_depth=1, num_running=2, incarnation="i1"))
    assert v.load_of("d") == 3 and v.others("d") == 1
    v.end("r1")
    v.end("r2")
    assert v.load_of("d") == 1
    v.mark_unhealthy("d")
    assert [x.worker_id for x in v.pool("decode")] == []
    clock.t += 3
    assert [x.worker_id for x in v.pool("decode")] == ["d"]
    v.mark_unhealthy("d")
    ch = v.update([w[0], WorkerInfo("d", "decode", "b:1", "i2")])
    assert ch.reincarnated == {"d"} and v.healthy("d") and v.load_of("d") == 0
    assert v.current("d", "i1") is None and v.current("d", "i2") is not None
    ch = v.update([w[0]])
    assert ch.removed == {"d"} and v.pool("decode") == []


def test_link_stats_learn_bandwidth_and_block_size():
    ls = LinkStats(default_Bps=1e9, alpha=0.5, min_sample_bytes=1000, bytes_per_block=100)
    ls.observe("p", "d", bytes_sent=500, seconds=1.0, blocks_sent=1)  # too small for bandwidth
    assert not ls.measured_from("p") and ls.bytes_per_block == 300
    ls.observe("p", "d", bytes_sent=4000, seconds=2.0, blocks_sent=10)
    ls.observe("p", "d", bytes_sent=8000, seconds=2.0, blocks_sent=20)
    assert ls.bandwidth("p", "d") == 3000 and ls.bandwidth("p", "x") == 1e9
    ls.forget("d")
    assert not ls.measured_from("p") and ls.rows == {}


def test_memory_store_leases_sessions_and_loads():
    clock = Clock()

    async def main():
        s = InMemoryStore(clock=clock)
        w1 = WorkerInfo("d0", "decode", "h:1", "i1", "L")
        await s.register(w1, 1.0)
        assert await s.heartbeat(w1, 1.0) == 1
        assert await s.heartbeat(WorkerInfo("d0", "decode", "h:1", "i0"), 1.0) == -1
        clock.t += 2
        assert await s.list_workers() == [] and await s.heartbeat(w1, 1.0) == 0
        await s.register(w1, 1.0)
        assert not await s.unregister(WorkerInfo("d0", "decode", "h:1", "other"))
        assert await s.unregister(w1) and await s.list_workers() == []
        b = SessionBinding(prefill_id="p", prefill_incarnation="1", decode_id="d", decode_incarnation="1",
                           expires_at=1e12)
        assert await s.put_session("s", b, 5.0, only_if_absent=True)
        assert not await s.put_session("s", b, 5.0, only_if_absent=True)
        assert await s.get_session("s") == b
        await s.put_load("d0", WorkerLoad(queue_depth=2), 1.0)
        assert (await s.get_loads())["d0"].queue_depth == 2
        clock.t += 2
        assert await s.get_loads() == {}
        await s.delete_session("s")
        assert await s.get_session("s") is None

    asyncio.run(main())


def test_wire_json_roundtrip_and_make_store():
    w = WorkerInfo("d0", "decode", "h:1", "i1", "L")
    assert worker_from_json(worker_to_json(w)) == w
    load = load_from_json(load_to_json(WorkerLoad(queue_depth=1, free_blocks=2, total_blocks=3)))
    assert load.queue_depth == 1 and load.reported_at > 0
    with pytest.raises(ValueError):
        worker_from_json('{"worker_id": "x", "role": "router", "address": "a"}')
    assert isinstance(make_store(None), InMemoryStore)
    r = make_store("redis://127.0.0.1:1/0")
    assert r.shared and r.ns == "pdserve"
    asyncio.run(r.close())


def test_prefix_index_evicts_a_chains_tail_before_its_head():
    idx = PrefixIndex(capacity=6)
    a = block_hashes(list(range(64)), 16)  # 4 blocks
    b = block_hashes(list(range(500, 564)), 16)  # 4 blocks, pushes 2 of a's out
    idx.add("w", a)
    idx.add("w", b)
    assert idx.match(a) == {"w": 2}  # a's head survives, so the match is still a usable prefix
    assert idx.match(b) == {"w": 4}
