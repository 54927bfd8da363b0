"""RedisLeaseDiscovery: the worker list is whoever holds a live lease in the shared store.

Every ``interval_s`` it lists the leases (router/state/store.py) and reports the list when it
changed. Fencing: once this router has seen a (worker_id, incarnation) go away (lease expired,
or replaced by a newer incarnation), that incarnation is dead for good here, even if a stale
lease with it shows up again. Workers whose KV-layout hash differs from ``expected_layout_hash``
(when given) are left out: their KV could not be exchanged with the others.
While the store is unreachable the last list stands (the store retries with capped backoff).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

from router.placement.types import WorkerInfo
from router.state.store import StoreUnavailable

log = logging.getLogger(__name__)


class RedisLeaseDiscovery:
    def __init__(self, store, *, interval_s: float = 0.5, expected_layout_hash: str = "",
                 max_tombstones: int = 10_000, on_error: Callable[[str], None] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.store = store
        self.interval_s = interval_s
        self.expected_layout_hash = expected_layout_hash
        self.max_tombstones = max_tombstones
        self._dead: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._last: dict[str, WorkerInfo] | None = None
        self._on_error = on_error

    def _bury(self, w: WorkerInfo) -> None:
        self._dead[(w.worker_id, w.incarnation)] = None
        while len(self._dead) > self.max_tombstones:
            self._dead.popitem(last=False)

    async def poll(self) -> list[WorkerInfo] | None:
        """One listing; returns the new list if it changed, None if unchanged or unreachable."""
        try:
            listed = await self.store.list_workers()
        except (StoreUnavailable, OSError, asyncio.TimeoutError) as e:
            if self._on_error is not None:
                self._on_error("redis")
            log.warning("worker lease listing failed, keeping the last view: %s", e)
            return None
        now: dict[str, WorkerInfo] = {}
        for w in listed:
            if (w.worker_id, w.incarnation) in self._dead:
                continue
            if self.expected_layout_hash and w.layout_hash != self.expected_layout_hash:
                log.warning("ignoring %s: KV layout %s != expected %s", w.worker_id, w.layout_hash,
                            self.expected_layout_hash)
                continue
            now[w.worker_id] = w
        prev = self._last or {}
        for wid, old in prev.items():
            cur = now.get(wid)
            if cur is None or cur.incarnation != old.incarnation:
                self._bury(old)
        if self._last is not None and now == self._last:
            return None
        self._last = now
        return sorted(now.values(), key=lambda w: w.worker_id)

    async def run(self, on_update: Callable[[list[WorkerInfo]], None]) -> None:
        while True:
            changed = await self.poll()
            if changed is not None:
                on_update(changed)
            await asyncio.sleep(self.interval_s)
