"""WorkerView: the router's one picture of the cluster.

Per worker, and nowhere else in the router: who it is (id, role, incarnation, KV layout), whether it
may be placed on (it answered its last poll and no request failed on it within the cooldown), its
load (its own report, corrected by what this router knows happened since), the placements this
router has made on it that are still open, and the prompt tokens this router has sent it to prefill
and not yet had answered (its queue, for the cost model's wait estimate).

Lifecycle of one placement: ``begin(request_id, prefill, decode, tokens)`` when the Placer commits
it; ``prefill_done(request_id)`` when the prompt leaves the prefill worker's queue (answered, failed,
or prefilled on the decode worker instead); ``end(request_id)`` when the request is over. A retried
placement replaces its predecessor, and ``end`` is idempotent, so nothing leaks whatever path a
request takes.

Incarnation fencing: ``update`` reports which worker ids changed incarnation or left, and the Placer
drops everything it learnt about them (prefix index, learned rates, bindings). A load report carrying
an older incarnation than the worker's current one is ignored, so a dead process's last words cannot
make its successor look busy or idle.

Why a report is corrected: a worker's ``GetStats`` is up to ``--stats-interval`` old, and it counts
this router's own requests as they were then. Counted as is, a request that just finished keeps its
worker looking busy until the next poll, and at equal load the worker that served a session's last
turn (the one holding its KV) looks *more* loaded than a cold one. So the load of a worker is this
router's open placements now plus the rest of the report beyond this router's open placements at the
time the report arrived: other routers' requests, and requests the worker holds that we do not know
of.
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


@dataclass
class _Open:
    prefill_id: str | None  # who computes the prompt; None: nobody yet to wait for (done, or no pool)
    decode_id: str
    prefill_tokens: int
    counted: bool = True  # the prompt counts as a request on prefill_id (not when the decode worker
                          # computes it: it is counted there once already)


class WorkerView:
    def __init__(self, *, unhealthy_cooldown_s: float, load_stale_s: float,
                 clock=time.monotonic, wall=time.time) -> None:
        self.unhealthy_cooldown_s = unhealthy_cooldown_s
        self.load_stale_s = load_stale_s
        self._clock = clock
        self._wall = wall
        self.workers: dict[str, WorkerInfo] = {}
        self.loads: dict[str, WorkerLoad] = {}
        self._unhealthy_until: dict[str, float] = {}
        self._incarnation: dict[str, str] = {}  # worker -> the incarnation last listed, also once it left
        self.version = 0  # bumps on every membership change; pool caches key on it
        self._pools: dict[str, list[WorkerInfo]] = {}
        # (others' requests on the worker beyond ours at report time, free or -1, total, at)
        self._rep: dict[str, tuple[int, int, int, float]] = {}
        self._open: dict[str, _Open] = {}       # request_id -> this router's open placement
        self._count: dict[str, int] = {}        # worker -> open placements loading it now
        self._tokens: dict[str, int] = {}       # prefill worker -> prompt tokens sent, not answered
        self._busy_since: dict[str, float] = {}  # worker -> when it began the head of that queue

    # ---------------------------------------------------------------- membership and liveness
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
            self._rep.pop(k, None)
            # A new incarnation is a fresh process: a failure of its predecessor says nothing about it.
            self._unhealthy_until.pop(k, None)
        for k in added:
            # Back after it left the view (its process died, polls failed meanwhile and marked it): a
            # restarted process is placeable at once; the same process back keeps its cooldown.
            if self._incarnation.get(k) != new[k].incarnation:
                self._unhealthy_until.pop(k, None)
        self._incarnation.update((k, w.incarnation) for k, w in new.items())
        if added or removed or reinc or new != old:
            self.version += 1
        self.workers = new
        self._pools = {role: sorted((w for w in new.values() if w.role == role), key=lambda w: w.worker_id)
                       for role in ("prefill", "decode")}
        return ViewChange(added=added, removed=removed, reincarnated=reinc)

    def mark_unhealthy(self, worker_id: str, cooldown_s: float | None = None) -> None:
        cd = self.unhealthy_cooldown_s if cooldown_s is None else cooldown_s
        self._unhealthy_until[worker_id] = self._clock() + cd

    def mark_healthy(self, worker_id: str) -> None:
        self._unhealthy_until.pop(worker_id, None)

    def healthy(self, worker_id: str) -> bool:
        """Known (answered its last poll) and not cooling down after a failure."""
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

    def current(self, worker_id: str, incarnation: str) -> WorkerInfo | None:
        """The worker if it is known, healthy and still under ``incarnation``."""
        w = self.workers.get(worker_id)
        if w is None or w.incarnation != incarnation or not self.healthy(worker_id):
            return None
        return w

    # ---------------------------------------------------------------- load
    def set_load(self, worker_id: str, load: WorkerLoad) -> bool:
        w = self.workers.get(worker_id)
        if w is None:
            return False
        if load.incarnation and w.incarnation and load.incarnation != w.incarnation:
            return False
        age = (self._wall() - load.reported_at) if load.reported_at else 0.0
        self.loads[worker_id] = load
        at = self._clock() - max(age, 0.0)
        others = max(load.queue_depth + load.num_running - self._count.get(worker_id, 0), 0)
        self._rep[worker_id] = (others, load.free_blocks if load.total_blocks else -1, load.total_blocks, at)
        return True

    def fresh_load(self, worker_id: str) -> WorkerLoad | None:
        rep = self._rep.get(worker_id)
        if rep is None or self._clock() - rep[3] > self.load_stale_s:
            return None
        return self.loads[worker_id]

    def others(self, worker_id: str) -> int:
        """Requests on the worker that are not this router's open placements (fresh report, else 0)."""
        rep = self._rep.get(worker_id)
        if rep is None or self._clock() - rep[3] > self.load_stale_s:
            return 0
        return rep[0]

    def load_of(self, worker_id: str) -> int:
        """Requests on the worker now: this router's open placements + everyone else's reported."""
        return self._count.get(worker_id, 0) + self.others(worker_id)

    def snapshot(self, pool: list[WorkerInfo], cached: dict[str, int] | None = None) -> list[tuple]:
        """Per worker ``(worker_id, load, cached, free_blocks or -1, total_blocks or 0)``, one clock
        read, one pass: the decision's hot loop (``cached`` = the prefix index's match, or none)."""
        oldest = self._clock() - self.load_stale_s
        reps, count = self._rep, self._count
        cget = (cached or {}).get
        out = []
        for w in pool:
            wid = w.worker_id
            own = count.get(wid, 0)
            rep = reps.get(wid)
            if rep is None or rep[3] < oldest:
                out.append((wid, own, cget(wid, 0), -1, 0))
            else:
                out.append((wid, own + rep[0], cget(wid, 0), rep[1], rep[2]))
        return out

    # ---------------------------------------------------------------- this router's open placements
    def begin(self, request_id: str, prefill_id: str | None, decode_id: str, prefill_tokens: int) -> None:
        """A placement is committed: it loads both workers, its prompt joins the prefill queue."""
        self.end(request_id)  # a retry replaces its predecessor
        tokens = max(int(prefill_tokens), 0) if prefill_id is not None else 0
        self._open[request_id] = _Open(prefill_id, decode_id, tokens)
        self._add(decode_id, 1)
        if prefill_id is not None:
            self._add(prefill_id, 1)
            self._queue(prefill_id, tokens)

    def prefill_done(self, request_id: str, *, answered: bool = False) -> None:
        """The prompt left its worker's queue: ``answered`` (that worker computed it and moves on to
        the next now), or failed, cancelled or moved to another worker (its progress is unknown)."""
        o = self._open.get(request_id)
        if o is None or o.prefill_id is None:
            return
        if o.counted:
            self._add(o.prefill_id, -1)
        left = self._tokens.get(o.prefill_id, 0) - o.prefill_tokens
        if left > 0:
            self._tokens[o.prefill_id] = left
            if answered:
                self._busy_since[o.prefill_id] = self._clock()  # it moves on to the next prompt now
        else:
            self._tokens.pop(o.prefill_id, None)
            self._busy_since.pop(o.prefill_id, None)
        o.prefill_id, o.prefill_tokens = None, 0

    def move_prefill(self, request_id: str, worker_id: str, tokens: int) -> None:
        """The decode worker computes the prompt instead (conditional disaggregation): its tokens
        leave the prefill worker's queue and join ``worker_id``'s, until ``prefill_done``."""
        o = self._open.get(request_id)
        if o is None:
            return
        self.prefill_done(request_id)
        o.prefill_id, o.prefill_tokens, o.counted = worker_id, max(int(tokens), 0), False
        self._queue(worker_id, o.prefill_tokens)

    def _queue(self, worker_id: str, tokens: int) -> None:
        if not self._tokens.get(worker_id):
            self._busy_since[worker_id] = self._clock()  # an idle worker starts on it at once
        self._tokens[worker_id] = self._tokens.get(worker_id, 0) + tokens

    def end(self, request_id: str) -> bool:
        """The request is over (idempotent); False if it was not open."""
        if request_id not in self._open:
            return False
        self.prefill_done(request_id)
        o = self._open.pop(request_id)
        self._add(o.decode_id, -1)
        return True

    def outstanding_tokens(self, worker_id: str) -> int:
        """Prompt tokens this router sent ``worker_id`` to prefill and has not had answered."""
        return self._tokens.get(worker_id, 0)

    def busy_for(self, worker_id: str) -> float:
        """Seconds the worker has been on the head of its queue (since it was sent to an idle worker,
        or since the worker's last answer): the share of the head already computed."""
        since = self._busy_since.get(worker_id)
        return max(self._clock() - since, 0.0) if since is not None else 0.0

    def own_prefill_tokens(self, request_id: str) -> int:
        o = self._open.get(request_id)
        return o.prefill_tokens if o is not None else 0

    def prefill_of(self, request_id: str) -> str | None:
        """The worker whose queue holds the open request's prompt (None: not open, or answered)."""
        o = self._open.get(request_id)
        return o.prefill_id if o is not None else None

    def inflight(self, worker_id: str) -> int:
        """This router's open placements loading ``worker_id`` (a prefill worker: until answered)."""
        return self._count.get(worker_id, 0)

    @property
    def open_total(self) -> int:
        return len(self._open)

    def _add(self, worker_id: str, delta: int) -> None:
        v = self._count.get(worker_id, 0) + delta
        if v > 0:
            self._count[worker_id] = v
        else:
            self._count.pop(worker_id, None)
