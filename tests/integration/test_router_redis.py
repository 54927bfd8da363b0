"""Router shared state against a real redis-server the tests start on a free port.

Two Placers with their own RedisStore clients play two router replicas. Covers: same placement
for the same session on both replicas (incl. a concurrent first turn), lease expiry, restart with
a new incarnation, fenced heartbeats, load reports shared, and Redis killed mid-run then
restarted (serving continues from the last view; the store reconnects with backoff).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest
import redis

from bench.placement_fakes import request
from pdserve.app.registration import LeaseConflict, WorkerRegistration
from pdserve.probe import free_port
from router.discovery.redis_leases import RedisLeaseDiscovery
from router.placement import Outcome, Placer, PlacerConfig, WorkerInfo, WorkerLoad
from router.state.redis_store import RedisStore
from router.state.store import StoreUnavailable

pytestmark = pytest.mark.timeout(60)


class RedisServer:
    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server binary not found (apt-get install redis-server)")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                c.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        c.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(5)
        self.proc = None

    def flush(self) -> None:
        c = redis.Redis(host="127.0.0.1", port=self.port)
        c.flushall()
        c.close()


@pytest.fixture(scope="module")
def redis_server():
    srv = RedisServer()
    srv.start()
    yield srv
    if srv.proc is not None:
        srv.kill()


@pytest.fixture
def server(redis_server):
    redis_server.flush()
    return redis_server


def _workers(inc: str = "i1") -> list[WorkerInfo]:
    return [WorkerInfo(f"p{i}", "prefill", f"h:{7000 + i}", inc, "L") for i in range(2)] + \
        [WorkerInfo(f"d{i}", "decode", f"h:{8000 + i}", inc, "L") for i in range(3)]


def _toks(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 30000 for i in range(n)]


def _replica(url: str, **kw) -> Placer:
    # Generous timeouts: CI machines stall; a dead Redis still fails fast (connection refused).
    cfg = PlacerConfig(policy="session+prefix", store_timeout_s=2.0, sync_interval_s=0.05, **kw)
    pl = Placer(cfg, RedisStore(url, socket_timeout_s=2.0, backoff_base_s=0.05, backoff_max_s=0.4))
    pl.update_workers(_workers())
    return pl


def test_two_replicas_agree_on_session_placement(server):
    async def main():
        a, b = _replica(server.url), _replica(server.url)
        # Make the replicas' local views disagree: B believes A's favourite decode is busy.
        for i in range(3):
            a.update_load(f"d{i}", WorkerLoad(queue_depth=i, free_blocks=100, total_blocks=100))
            b.update_load(f"d{i}", WorkerLoad(queue_depth=2 - i, free_blocks=100, total_blocks=100))
        history = _toks(64, 1)
        pairs = []
        for turn in range(6):
            pl = (a, b)[turn % 2]  # turns alternate between router replicas
            r = request(f"t{turn}", history, session_id="chat-1")
            p = await pl.aplace(r)
            pairs.append((p.prefill.worker_id, p.decode.worker_id))
            assert p.session_hit == (turn > 0)
            pl.on_result(r, p, Outcome(success=True, decode_block_hashes=r.block_hashes))
            history += _toks(40, turn + 2)
        assert len(set(pairs)) == 1
        # A concurrent first turn on both replicas: set-if-absent picks one pair, both adopt it.
        got = await asyncio.gather(a.aplace(request("x1", _toks(64, 9), session_id="chat-2")),
                                   b.aplace(request("x2", _toks(64, 9), session_id="chat-2")))
        assert {(g.prefill.worker_id, g.decode.worker_id) for g in got} == \
            {(got[0].prefill.worker_id, got[0].decode.worker_id)}
        # A move decided on one replica is what the other sees next.
        bound = got[0].decode.worker_id
        a.mark_unhealthy(bound)
        moved = await a.aplace(request("x3", _toks(80, 9), session_id="chat-2"))
        assert moved.session_moved and moved.decode.worker_id != bound
        b.update_workers([w for w in _workers() if w.worker_id != bound])  # B learns it left too
        nxt = await b.aplace(request("x4", _toks(96, 9), session_id="chat-2"))
        assert nxt.session_hit and nxt.decode.worker_id == moved.decode.worker_id
        for pl in (a, b):
            await pl.close()

    asyncio.run(main())


def test_loads_are_shared_between_replicas(server):
    async def main():
        a, b = _replica(server.url), _replica(server.url)
        await a.start()
        await b.start()
        a.update_load("d1", WorkerLoad(queue_depth=7, num_running=3, free_blocks=5, total_blocks=50))
        deadline = time.monotonic() + 30  # a few sync intervals normally; far more on a loaded machine
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            got = b.view.fresh_load("d1")
            if got is not None and got.queue_depth == 7:
                break
        assert b.view.load_of("d1") == 10
        await a.close()
        await b.close()

    asyncio.run(main())


def test_lease_expiry_and_restart_with_new_incarnation(server):
    async def main():
        store = RedisStore(server.url, socket_timeout_s=2.0)
        disc = RedisLeaseDiscovery(RedisStore(server.url, socket_timeout_s=2.0), interval_s=0.05)
        pl = Placer(PlacerConfig(policy="session+prefix"))
        # Long leases for the live workers, so a stalled test machine never expires them by accident.
        regs = [WorkerRegistration(store, worker_id=w.worker_id, role=w.role, address=w.address,
                                   layout_hash="L", ttl_s=10.0, interval_s=0.2) for w in _workers()]
        for r in regs:
            await r.start()
        pl.update_workers(await disc.poll())
        assert len(pl.view.workers) == 5
        req = request("a", _toks(64, 3), session_id="s")
        first = pl.place(req)
        pl.on_result(req, first, Outcome(success=True, decode_block_hashes=req.block_hashes))
        victim = next(r for r in regs if r.info.worker_id == first.decode.worker_id)
        old_inc = victim.incarnation

        # The decode worker dies without unregistering: its lease expires and it disappears. (Its
        # last heartbeat is replayed with a short TTL so the test need not wait out 10 s.)
        await victim.stop(unregister=False)
        await store.register(victim.info, 0.3)
        for _ in range(200):
            await asyncio.sleep(0.05)
            changed = await disc.poll()
            if changed is not None:
                pl.update_workers(changed)
            if victim.info.worker_id not in pl.view.workers:
                break
        assert victim.info.worker_id not in pl.view.workers
        moved = pl.place(request("b", _toks(80, 3), session_id="s"))
        assert moved.session_moved and moved.decode.worker_id != victim.info.worker_id
        assert moved.move_reason == f"{victim.info.worker_id} gone"

        # A late heartbeat of the dead incarnation cannot resurrect the lease...
        assert await store.heartbeat(victim.info, 5.0) == 0
        # ...the restarted process registers under a new incarnation and is routable again.
        reborn = WorkerRegistration(store, worker_id=victim.info.worker_id, role="decode",
                                    address=victim.info.address, layout_hash="L", ttl_s=10.0, interval_s=0.2)
        await reborn.start()
        assert reborn.incarnation != old_inc
        changed = await disc.poll()
        pl.update_workers(changed)
        assert pl.view.workers[victim.info.worker_id].incarnation == reborn.incarnation
        # An old incarnation re-appearing (stale lease written back) is fenced by the tombstone.
        await store.register(victim.info, 5.0)  # victim.info still carries old_inc
        changed = await disc.poll()
        if changed is not None:
            pl.update_workers(changed)
        assert victim.info.worker_id not in pl.view.workers
        # ...and the reborn process, now fenced out by that register, learns it on its next beat.
        with pytest.raises(LeaseConflict):
            await reborn.heartbeat()
        await reborn.stop()
        for r in regs:
            await r.stop()
        assert await store.list_workers() == [] or all(
            w.worker_id == victim.info.worker_id for w in await store.list_workers())
        await store.close()
        await disc.store.close()

    asyncio.run(main())


def test_expired_lease_reregisters_under_new_incarnation(server):
    async def main():
        store = RedisStore(server.url, socket_timeout_s=2.0)
        seen = []
        reg = WorkerRegistration(store, worker_id="p9", role="prefill", address="h:1", ttl_s=0.3,
                                 interval_s=0.1, on_reincarnate=seen.append,
                                 load_fn=lambda: WorkerLoad(queue_depth=1, free_blocks=3, total_blocks=9))
        await reg.register()
        first = reg.incarnation
        await asyncio.sleep(0.5)  # stalled longer than the TTL
        assert await store.list_workers() == []
        assert await reg.heartbeat()
        assert reg.incarnation != first and seen == [reg.incarnation]
        (w,) = await store.list_workers()
        assert w.incarnation == reg.incarnation
        assert (await store.get_loads())["p9"].incarnation == reg.incarnation
        assert await store.unregister(reg.info) and await store.list_workers() == []
        await store.close()

    asyncio.run(main())


def test_redis_killed_mid_run_then_restarted(server):
    async def main():
        a = _replica(server.url)
        await a.start()
        r0 = request("r0", _toks(64, 5), session_id="s")
        p0 = await a.aplace(r0)
        a.on_result(r0, p0, Outcome(success=True))
        server.kill()
        placed = []
        for i in range(20):  # serving continues from the local view (connection refused: no stall)
            r = request(f"k{i}", _toks(64 + 16 * i, 5), session_id="s")
            p = await asyncio.wait_for(a.aplace(r), 10)
            placed.append(p)
            a.on_result(r, p, Outcome(success=True))
        assert all(p.session_hit and p.decode.worker_id == p0.decode.worker_id for p in placed)
        errors = sum(c._value.get() for c in a.metrics.redis_errors._metrics.values())
        assert errors >= 1
        assert not a.store.available

        server.start()  # same port, empty (no persistence): the binding must be re-established
        deadline = time.monotonic() + 20
        while not a.store.available and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            await asyncio.wait_for(a.aplace(request("back", _toks(64, 5), session_id="s")), 5)
        assert a.store.available and a.store.reconnects >= 1
        p = await asyncio.wait_for(a.aplace(request("back2", _toks(64, 5), session_id="s")), 5)
        assert p.decode.worker_id == p0.decode.worker_id
        # On a loaded machine the freshly restarted server can still time out a call, which puts
        # the store back into its backoff window; read again once the window has passed.
        stored = None
        deadline = time.monotonic() + 20
        while stored is None and time.monotonic() < deadline:
            try:
                stored = await asyncio.wait_for(a.store.get_session("s"), 5)
            except (StoreUnavailable, asyncio.TimeoutError):
                await asyncio.sleep(0.05)
                continue
            if stored is None:
                await asyncio.wait_for(a.aplace(request("back3", _toks(64, 5), session_id="s")), 5)
        assert stored is not None and stored.decode_id == p0.decode.worker_id
        await asyncio.wait_for(a.close(), 10)

    # Every await above is bounded, and so is the whole scenario: a hang fails here with the
    # coroutine's traceback (where it was stuck) instead of a bare pytest-timeout in the selector.
    asyncio.run(asyncio.wait_for(main(), 50))
