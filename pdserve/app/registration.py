"""Worker-side lease registration: how a prefill/decode worker announces itself to the routers.

Lifecycle (one ``WorkerRegistration`` per worker process):

    reg = WorkerRegistration(store, worker_id="d0", role="decode", address="10.0.0.5:7002",
                             layout_hash=layout.hash(), load_fn=engine_load)
    await reg.start()      # register (new incarnation id), then heartbeat every ttl/3
    ...
    await reg.stop()       # unregister: routers stop sending at once instead of after the TTL

Each heartbeat refreshes the lease only if it still holds *this* incarnation (a Lua script in
Redis). If the lease expired (the process stalled longer than the TTL) routers have already
forgotten this incarnation, so the registration takes a *new* incarnation id and registers again
(``on_reincarnate`` lets the worker drop state the routers no longer know about). If another
process holds the id (a restarted twin), this one stops heartbeating: two live processes must
never share a worker id. ``load_fn`` (optional) is published with every heartbeat so routers see
queue depth and free KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

from router.placement.types import WorkerInfo, WorkerLoad
from router.state.store import StoreUnavailable

log = logging.getLogger(__name__)


def new_incarnation() -> str:
    return uuid.uuid4().hex


class LeaseConflict(RuntimeError):
    """Another incarnation holds this worker id."""


class WorkerRegistration:
    def __init__(self, store, *, worker_id: str, role: str, address: str, layout_hash: str = "",
                 ttl_s: float = 10.0, interval_s: float | None = None,
                 load_fn: Callable[[], WorkerLoad] | None = None,
                 on_reincarnate: Callable[[str], None] | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.store = store
        self.ttl_s = ttl_s
        self.interval_s = interval_s if interval_s is not None else ttl_s / 3
        if not 0 < self.interval_s < ttl_s:
            raise ValueError("heartbeat interval must be in (0, ttl_s)")
        self.info = WorkerInfo(worker_id=worker_id, role=role, address=address,
                               incarnation=new_incarnation(), layout_hash=layout_hash)
        self.load_fn = load_fn
        self.on_reincarnate = on_reincarnate
        self.conflict = False
        self.registered = False
        self._task: asyncio.Task | None = None

    @property
    def incarnation(self) -> str:
        return self.info.incarnation

    async def register(self) -> None:
        await self.store.register(self.info, self.ttl_s)
        self.registered = True

    async def heartbeat(self) -> bool:
        """One beat; True if the lease is held (possibly under a new incarnation)."""
        r = await self.store.heartbeat(self.info, self.ttl_s)
        if r == -1:
            self.conflict = True
            raise LeaseConflict(f"worker id {self.info.worker_id!r} is held by another incarnation")
        if r == 0:
            old = self.info.incarnation
            self.info = WorkerInfo(worker_id=self.info.worker_id, role=self.info.role,
                                   address=self.info.address, incarnation=new_incarnation(),
                                   layout_hash=self.info.layout_hash)
            log.warning("lease of %s (incarnation %s) expired; re-registering as %s",
                        self.info.worker_id, old, self.info.incarnation)
            await self.register()
            if self.on_reincarnate is not None:
                self.on_reincarnate(self.info.incarnation)
        if self.load_fn is not None:
            load = self.load_fn()
            if load.incarnation != self.info.incarnation:
                load = WorkerLoad(queue_depth=load.queue_depth, num_running=load.num_running,
                                  free_blocks=load.free_blocks, total_blocks=load.total_blocks,
                                  incarnation=self.info.incarnation, reported_at=load.reported_at)
            await self.store.put_load(self.info.worker_id, load, self.ttl_s)
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if not self.registered:
                    await self.register()
                    log.info("lease of %s registered (incarnation %s)", self.info.worker_id,
                             self.info.incarnation)
                await self.heartbeat()
            except LeaseConflict:
                log.error("stopping heartbeats: %s", self.info.worker_id)
                return
            except (StoreUnavailable, OSError, asyncio.TimeoutError) as e:
                log.warning("heartbeat failed (will retry): %s", e)

    async def start(self) -> None:
        """Register, or when the store cannot be reached keep trying from the heartbeat loop: a worker
        (re)started during a Redis outage serves (the router may know it another way) instead of exiting."""
        try:
            await self.register()
        except (StoreUnavailable, OSError, asyncio.TimeoutError) as e:
            log.warning("lease registration of %s failed, retrying every %.1fs: %s", self.info.worker_id,
                        self.interval_s, e)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self, unregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if unregister and self.registered and not self.conflict:
            with contextlib.suppress(StoreUnavailable, OSError):
                await self.store.unregister(self.info)
