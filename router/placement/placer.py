"""Placer (minimal first cut): round robin over the current worker list, same interface as the real one."""

from __future__ import annotations

import time

from router.placement.config import PlacerConfig
from router.placement.types import (
    NoWorkersAvailable,
    Outcome,
    Placement,
    PlacementRequest,
    WorkerInfo,
    WorkerLoad,
)


class Placer:
    def __init__(self, config: PlacerConfig | None = None, store: object | None = None) -> None:
        self.config = config or PlacerConfig()
        self.store = store
        self._workers: dict[str, WorkerInfo] = {}
        self._loads: dict[str, WorkerLoad] = {}
        self._unhealthy_until: dict[str, float] = {}
        self._rr = {"prefill": 0, "decode": 0}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def update_workers(self, workers: list[WorkerInfo]) -> None:
        self._workers = {w.worker_id: w for w in workers}

    def update_load(self, worker_id: str, load: WorkerLoad) -> None:
        self._loads[worker_id] = load

    def mark_unhealthy(self, worker_id: str) -> None:
        self._unhealthy_until[worker_id] = time.monotonic() + self.config.unhealthy_cooldown_s

    def _pick(self, role: str, exclude: frozenset[str] | set[str]) -> WorkerInfo:
        now = time.monotonic()
        pool = sorted(
            (w for w in self._workers.values()
             if w.role == role and w.worker_id not in exclude
             and self._unhealthy_until.get(w.worker_id, 0.0) <= now),
            key=lambda w: w.worker_id,
        )
        if not pool:
            raise NoWorkersAvailable(f"no healthy {role} worker")
        w = pool[self._rr[role] % len(pool)]
        self._rr[role] += 1
        return w

    def place(self, req: PlacementRequest, exclude: frozenset[str] | set[str] = frozenset()) -> Placement:
        p = self._pick("prefill", exclude)
        d = self._pick("decode", exclude)
        return Placement(prefill=p, decode=d, policy="round_robin", reason="round_robin")

    async def aplace(
        self, req: PlacementRequest, exclude: frozenset[str] | set[str] = frozenset()
    ) -> Placement:
        return self.place(req, exclude)

    def on_result(self, req: PlacementRequest, placement: Placement, outcome: Outcome) -> None:
        if not outcome.success and outcome.failed_worker_id:
            self.mark_unhealthy(outcome.failed_worker_id)
