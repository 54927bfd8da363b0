"""SessionSync keeps the bindings it decided while the store was down and writes them once it is back."""

from __future__ import annotations

import asyncio

from router.metrics import RouterMetrics
from router.placement.config import PlacerConfig
from router.placement.session_sync import SessionSync
from router.state import InMemoryStore
from router.state.sessions import SessionBinding, SessionTable
from router.state.store import StoreUnavailable
from router.state.workers import WorkerView


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FlakyStore(InMemoryStore):
    """An in-memory store that refuses everything while ``down`` (as a Redis outage does)."""

    shared = True

    def __init__(self, clock) -> None:
        super().__init__(clock=clock)
        self.down = False

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in ("get_session", "put_session", "get_loads", "put_load") and self.down:
            async def refuse(*_a, **_k):
                raise StoreUnavailable("down")
            return refuse
        return attr


def _binding(decode: str, expires_at: float) -> SessionBinding:
    return SessionBinding(prefill_id="p0", prefill_incarnation="pi", decode_id=decode,
                          decode_incarnation=decode + "-inc", expires_at=expires_at)


def _sync(clock: Clock) -> tuple[SessionSync, FlakyStore, RouterMetrics]:
    store = FlakyStore(clock)
    metrics = RouterMetrics()
    cfg = PlacerConfig()
    sync = SessionSync(store=store, config=cfg, view=WorkerView(unhealthy_cooldown_s=1.0, load_stale_s=5.0,
                                                                 clock=clock, wall=clock),
                       sessions=SessionTable(cfg.max_sessions, clock=clock), metrics=metrics, wall=clock)
    return sync, store, metrics


def test_a_binding_decided_while_the_store_is_down_is_written_when_it_returns() -> None:
    async def scenario() -> None:
        clock = Clock()
        sync, store, metrics = _sync(clock)
        store.down = True
        assert await sync.write("s", _binding("d1", clock.t + 600), only_if_absent=True) is None
        await sync.write("s", _binding("d2", clock.t + 601), only_if_absent=False)  # the newer decision
        assert sync.unwritten == 1
        await sync.sync_once()  # still down: kept
        assert sync.unwritten == 1 and metrics.redis_errors.labels(op="put_session")._value.get() >= 2
        store.down = False  # back, empty
        await sync.sync_once()
        assert sync.unwritten == 0
        assert (await store.get_session("s")).decode_id == "d2"

    asyncio.run(scenario())


def test_a_newer_binding_in_the_store_wins_an_older_one_is_replaced() -> None:
    async def scenario() -> None:
        clock = Clock()
        sync, store, _ = _sync(clock)
        store.down = True
        await sync.write("newer-elsewhere", _binding("mine", clock.t + 600), only_if_absent=False)
        await sync.write("stale-snapshot", _binding("mine", clock.t + 600), only_if_absent=False)
        store.down = False
        # another replica decided after us; a restored snapshot holds a binding from before the outage
        await store.put_session("newer-elsewhere", _binding("theirs", clock.t + 700), 600)
        await store.put_session("stale-snapshot", _binding("dead", clock.t + 100), 600)
        await sync.sync_once()
        assert sync.unwritten == 0
        assert (await store.get_session("newer-elsewhere")).decode_id == "theirs"
        assert (await store.get_session("stale-snapshot")).decode_id == "mine"

    asyncio.run(scenario())


def test_unwritten_bindings_expire_and_stay_bounded() -> None:
    async def scenario() -> None:
        clock = Clock()
        sync, store, _ = _sync(clock)
        sync.config = PlacerConfig(max_sessions=3)
        store.down = True
        for i in range(5):
            await sync.write(f"s{i}", _binding("d", clock.t + 10), only_if_absent=False)
        assert sync.unwritten == 3  # the oldest two dropped
        clock.t += 11  # every pending binding has expired: nothing is written back
        store.down = False
        await sync.sync_once()
        assert sync.unwritten == 0 and await store.get_session("s4") is None

    asyncio.run(scenario())
