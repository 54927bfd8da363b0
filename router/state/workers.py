"""WorkerView: the router's current picture of the pools: who exists, under which incarnation,
how loaded, and whether it recently failed.

Incarnation fencing lives here: ``update_workers`` reports which worker ids changed incarnation
or left, and the Placer drops everything it learnt about them (prefix index, bindings). A load
report carrying an older incarnation than the worker's current one is ignored, so a dead
process's last words cannot make its successor look busy or idle.

In-flight counts are this replica's own placements not yet closed by ``on_result``; they are
combined with the worker's reported queue (``load_of``) for bounded-load decisions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from router.placement.types import WorkerInfo, WorkerLoad


@dataclass(frozen=True)
class ViewChange:
    added: frozenset[str]
    removed: frozenset[str]
    reincarnated: frozenset[str]


class WorkerView:
    def __init__(self, *, unhealthy_cooldown_s: float, load_stale_s: float,
                 clock=time.monotonic, wall=time.time) -> None:
        self.unhealthy_cooldown_s = unhealthy_cooldown_s
        self.load_stale_s = load_stale_s
        self._clock = clock
        self._wall = wall
        self.workers: dict[str, WorkerInfo] = {}
        self.loads: dict[str, WorkerLoad] = {}
        self._load_at: dict[str, float] = {}
        self.inflight: dict[str, int] = {}
        self._unhealthy_until: dict[str, float] = {}
        self.version = 0  # bumps on every membership change; pool caches key on it
        self._pools: dict[str, list[WorkerInfo]] = {}
        self._rep: dict[str, tuple[int, int, int, float]] = {}

    def update(self, workers: list[WorkerInfo]) -> ViewChange:
        new = {}
        for w in workers:
            if w.worker_id in new and new[w.worker_id] != w:
                raise ValueError(f"worker id {w.worker_id!r} listed twice with different details")
            new[w.worker_id] = w
        old = self.workers
        added = frozenset(new.keys() - old.keys())
        removed = frozenset(old.keys() - new.keys())
        reinc = frozenset(k for k in new.keys() & old.keys()
                          if new[k].incarnation != old[k].incarnation or new[k].role != old[k].role)
        for k in removed | reinc:
            self.loads.pop(k, None)
            self._load_at.pop(k, None)
            self._rep.pop(k, None)
            self.inflight.pop(k, None)
            # A new incarnation is a fresh process: a failure of its predecessor says nothing about it.
            self._unhealthy_until.pop(k, None)
        if added or removed or reinc or new != old:
            self.version += 1
        self.workers = new
        self._pools = {role: sorted((w for w in new.values() if w.role == role), key=lambda w: w.worker_id)
                       for role in ("prefill", "decode")}
        return ViewChange(added=added, removed=removed, reincarnated=reinc)

    def set_load(self, worker_id: str, load: WorkerLoad) -> bool:
        w = self.workers.get(worker_id)
        if w is None:
            return False
        if load.incarnation and w.incarnation and load.incarnation != w.incarnation:
            return False
        age = (self._wall() - load.reported_at) if load.reported_at else 0.0
        self.loads[worker_id] = load
        at = self._clock() - max(age, 0.0)
        self._load_at[worker_id] = at
        # What the hot path needs, in one tuple: (queue + running, free or -1, total, at).
        self._rep[worker_id] = (load.queue_depth + load.num_running,
                                load.free_blocks if load.total_blocks else -1, load.total_blocks, at)
        return True

    def fresh_load(self, worker_id: str) -> WorkerLoad | None:
        at = self._load_at.get(worker_id)
        if at is None or self._clock() - at > self.load_stale_s:
            return None
        return self.loads[worker_id]

    def load_of(self, worker_id: str) -> int:
        """Requests on the worker: max(reported queue + running, this replica's own in-flight)."""
        own = self.inflight.get(worker_id, 0)
        rep = self.fresh_load(worker_id)
        if rep is None:
            return own
        return max(own, rep.queue_depth + rep.num_running)

    def mark_unhealthy(self, worker_id: str, cooldown_s: float | None = None) -> None:
        cd = self.unhealthy_cooldown_s if cooldown_s is None else cooldown_s
        self._unhealthy_until[worker_id] = self._clock() + cd

    def mark_healthy(self, worker_id: str) -> None:
        self._unhealthy_until.pop(worker_id, None)

    def healthy(self, worker_id: str) -> bool:
        until = self._unhealthy_until.get(worker_id)
        if until is None:
            return worker_id in self.workers
        if until <= self._clock():
            del self._unhealthy_until[worker_id]
            return worker_id in self.workers
        return False

    def pool(self, role: str, exclude: frozenset[str] | set[str] = frozenset()) -> list[WorkerInfo]:
        """Healthy, non-excluded workers of ``role`` in worker-id order (deterministic across replicas)."""
        base = self._pools.get(role, [])
        if not exclude and not self._unhealthy_until:
            return base  # the common case costs nothing; callers never mutate it
        return [w for w in base if w.worker_id not in exclude and self.healthy(w.worker_id)]

    def snapshot(self, pool: list[WorkerInfo], cached: dict[str, int] | None = None) -> list[tuple]:
        """Per worker ``(worker_id, load, cached, free_blocks or -1, total_blocks or 0)``, one clock
        read, one pass: the decision's hot loop (``cached`` = the prefix index's match, or none)."""
        oldest = self._clock() - self.load_stale_s
        reps, inflight = self._rep, self.inflight
        cget = (cached or {}).get
        out = []
        for w in pool:
            wid = w.worker_id
            own = inflight.get(wid, 0)
            rep = reps.get(wid)
            if rep is None or rep[3] < oldest:
                out.append((wid, own, cget(wid, 0), -1, 0))
            else:
                out.append((wid, rep[0] if rep[0] > own else own, cget(wid, 0), rep[1], rep[2]))
        return out

    def current(self, worker_id: str, incarnation: str) -> WorkerInfo | None:
        """The worker if it is known, healthy and still under ``incarnation``."""
        w = self.workers.get(worker_id)
        if w is None or w.incarnation != incarnation or not self.healthy(worker_id):
            return None
        return w

    def add_inflight(self, worker_id: str, delta: int) -> None:
        v = self.inflight.get(worker_id, 0) + delta
        self.inflight[worker_id] = max(v, 0)
