"""A worker that starts while its Redis is down still starts: the lease is registered by the heartbeat
loop once the store answers, under the incarnation the worker started with, and stop() unregisters only
a lease it holds."""

from __future__ import annotations

import asyncio

from pdserve.app.registration import WorkerRegistration
from router.state.store import StoreUnavailable


class FlakyStore:
    def __init__(self, down_calls: int) -> None:
        self.down_calls, self.registered, self.unregistered = down_calls, [], []
        self.up = asyncio.Event()

    async def register(self, info, ttl_s) -> None:
        if self.down_calls > 0:
            self.down_calls -= 1
            raise StoreUnavailable("redis down")
        self.registered.append(info.incarnation)
        self.up.set()

    async def heartbeat(self, info, ttl_s) -> int:
        return 1

    async def unregister(self, info) -> bool:
        self.unregistered.append(info.incarnation)
        return True


def test_start_during_an_outage_registers_when_the_store_returns() -> None:
    async def main() -> None:
        store = FlakyStore(down_calls=3)
        reg = WorkerRegistration(store, worker_id="d0", role="decode", address="h:1", ttl_s=0.3)
        inc = reg.incarnation
        await reg.start()  # does not raise
        assert not reg.registered
        await asyncio.wait_for(store.up.wait(), 30)
        assert store.registered == [inc] and reg.registered and reg.incarnation == inc
        await reg.stop()
        assert store.unregistered == [inc]

    asyncio.run(main())


def test_stop_without_a_lease_unregisters_nothing() -> None:
    async def main() -> None:
        store = FlakyStore(down_calls=10**6)
        reg = WorkerRegistration(store, worker_id="d0", role="decode", address="h:1", ttl_s=10)
        await reg.start()
        await reg.stop()
        assert store.registered == [] and store.unregistered == []

    asyncio.run(main())
