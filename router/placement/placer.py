"""Placer: the router's placement brain.

Lifecycle of one request:

1. ``place(req)`` (sync, no I/O) or ``await aplace(req)`` (reads the session binding from the
   shared store first, so router replicas agree). Decision by policy:
   - ``prefix`` (default; ``session+prefix`` is the same): a request with a session id goes to its
     session's bound pair while both workers are current (same incarnation), healthy, not excluded
     and within the session load bound; otherwise, and for requests without a session id, the best
     (prefill, decode) *pair* by the cost model under the bounded-load rule (scoring.py), and the
     binding moves, reporting ``session_moved``, ``moved_from`` and ``move_reason``.
   - ``prefix_only``: the pair score alone, session ids ignored.
   - ``round_robin`` / ``least_loaded``: each pool on its own.
   Without a prefill pool (``prefill_pool=False``: the router fronts colocated workers) the same
   rules pick a decode worker alone. The decision is then *committed*: the worker view opens the
   placement (load on both workers, the prompt's uncached tokens in the prefill worker's queue), the
   request's reusable blocks are optimistically added to both workers' entries in the prefix index,
   the binding is refreshed.
2. The pipeline runs the request, tells the view when the prompt has left the prefill queue
   (``prefill_done``), and calls ``on_result(req, placement, outcome)``: the placement closes, the
   index learns what the workers really hold, the cost model learns rates and link bandwidth, a
   failed worker is marked unhealthy for a cooldown.
3. Membership comes from the worker directory through ``update_workers``: a worker that left or
   came back under a new incarnation loses everything learnt about it; bindings naming an old
   incarnation are dead (the session moves on its next turn). ``update_load`` feeds queue/KV reports,
   ``apply_cache_events`` the workers' own cache events (what each tier gained and lost): the index
   then follows what they hold rather than what placement guessed, and a block a worker holds only
   in its host or disk tier costs its load time in the pair score (below a device hit, far below a
   recompute).

With a shared store (Redis) ``start()`` runs a background task that publishes this replica's
load reports and pulls everyone's; if the store is down the Placer keeps deciding from its last
view and the store reconnects with capped backoff (redis_store.py).
"""

from __future__ import annotations

import dataclasses
import time

from router.costs import CostModel
from router.metrics import RouterMetrics
from router.placement.config import PlacerConfig
from router.placement.scoring import (
    Candidate,
    PairChoice,
    choose_pair,
    load_cap,
    overloaded,
    session_bound,
)
from router.placement.session_sync import SessionSync
from router.placement.types import (
    NoWorkersAvailable,
    Outcome,
    Placement,
    PlacementRequest,
    WorkerInfo,
    WorkerLoad,
)
from router.state.prefix_index import PrefixIndex
from router.state.sessions import SessionBinding, SessionTable
from router.state.store import InMemoryStore, StateStore
from router.state.workers import WorkerView

Exclude = frozenset[str] | set[str]


def _same_pair(a: SessionBinding, b: SessionBinding) -> bool:
    return (a.prefill_id, a.prefill_incarnation, a.decode_id, a.decode_incarnation) == \
        (b.prefill_id, b.prefill_incarnation, b.decode_id, b.decode_incarnation)


class Placer:
    def __init__(self, config: PlacerConfig | None = None, store: StateStore | None = None, *,
                 metrics: RouterMetrics | None = None, clock=time.monotonic, wall=time.time) -> None:
        self.config = cfg = config or PlacerConfig()
        self.store: StateStore = store if store is not None else InMemoryStore()
        self.metrics = metrics or RouterMetrics()
        store_counts = self.store.on_error is not None or not self.store.shared
        if not store_counts:
            self.store.on_error = lambda op: self.metrics.redis_errors.labels(op=op).inc()
        self._wall = wall
        self.view = WorkerView(unhealthy_cooldown_s=cfg.unhealthy_cooldown_s, load_stale_s=cfg.load_stale_s,
                               clock=clock, wall=wall)
        self.metrics.watch_worker_load(self.view)
        self.costs = CostModel(cfg.costs, block_size=cfg.block_size, clock=clock)
        self.index = PrefixIndex(cfg.index_blocks_per_worker)
        self.sessions = SessionTable(cfg.max_sessions, clock=wall)
        self._rr = {"prefill": 0, "decode": 0}
        self._sync = SessionSync(store=self.store, config=cfg, view=self.view, sessions=self.sessions,
                                 metrics=self.metrics, store_counts_errors=self.store.shared, wall=wall)

    # ---------------------------------------------------------------- lifecycle (shared store)
    async def start(self) -> None:
        await self._sync.start()

    async def close(self) -> None:
        await self._sync.close()

    # ---------------------------------------------------------------- membership and load
    def update_workers(self, workers: list[WorkerInfo]) -> None:
        change = self.view.update(list(workers))
        for wid in change.removed | change.reincarnated:
            self.index.drop(wid)
            self.costs.forget(wid)
        for w in workers:
            self.costs.set_layout(w.worker_id, kv_bytes_per_block=w.kv_bytes_per_block,
                                  block_size=w.block_size)
        for role in ("prefill", "decode"):
            self.metrics.workers.labels(pool=role).set(sum(1 for w in self.view.workers.values()
                                                           if w.role == role))

    def update_load(self, worker_id: str, load: WorkerLoad) -> None:
        if not load.reported_at:
            load = dataclasses.replace(load, reported_at=self._wall())
        if self.view.set_load(worker_id, load) and self.store.shared:
            self._sync.publish_load(worker_id, load)

    def apply_cache_events(self, worker_id: str, *, snapshot: bool,
                           batches: list[tuple[str, bool, list[int]]]) -> None:
        """A worker's cache events (engine/kv_events.py) in order, or a snapshot of all it holds
        (what the index knew of it is forgotten first; the slowest tier is stamped first, so the
        index's LRU keeps the device blocks longest)."""
        if snapshot:
            self.index.drop(worker_id)
            rank = {"disk": 0, "host": 1, "device": 2}
            batches = sorted(batches, key=lambda b: rank.get(b[0], 0))
        for tier, stored, hashes in batches:
            self.index.apply(worker_id, tier, stored, hashes)

    def mark_unhealthy(self, worker_id: str) -> None:
        self.view.mark_unhealthy(worker_id)

    def mark_healthy(self, worker_id: str) -> None:
        self.view.mark_healthy(worker_id)

    # ---------------------------------------------------------------- placement
    def _limit(self, req: PlacementRequest) -> int:
        n = len(req.block_hashes)
        if req.reusable_prefix_len is None:
            return n
        return min(n, req.reusable_prefix_len // self.config.block_size)

    def place(self, req: PlacementRequest, exclude: Exclude = frozenset()) -> Placement:
        placement, binding = self._decide(req, exclude, self._session_binding(req))
        self._commit(req, placement, binding)
        return placement

    async def aplace(self, req: PlacementRequest, exclude: Exclude = frozenset()) -> Placement:
        """Like ``place`` but agrees with other replicas on the session binding via the store."""
        if not (self.store.shared and req.session_id and self.config.session_aware):
            return self.place(req, exclude)
        shared = await self._sync.fetch(req.session_id)
        local = self._session_binding(req)
        # The store is the truth; if it lost the binding (Redis restarted empty) our local copy
        # competes for it with set-if-absent, and whoever wins, every replica adopts.
        start = shared if isinstance(shared, SessionBinding) else local
        placement, binding = self._decide(req, exclude, start)
        if binding is not None and shared is None:
            won = await self._sync.write(req.session_id, binding, only_if_absent=True)
            if won is False:
                winner = await self._sync.fetch(req.session_id)
                if isinstance(winner, SessionBinding):
                    placement, binding = self._decide(req, exclude, winner)
                    if binding is not None and placement.session_moved:
                        await self._sync.write(req.session_id, binding, only_if_absent=False)
        elif binding is not None and isinstance(shared, SessionBinding) and not _same_pair(shared, binding):
            await self._sync.write(req.session_id, binding, only_if_absent=False)
        elif binding is not None:
            self._sync.refresh_later(req.session_id, binding)
        self._commit(req, placement, binding)
        return placement

    def _session_binding(self, req: PlacementRequest) -> SessionBinding | None:
        if not (req.session_id and self.config.session_aware):
            return None
        return self.sessions.get(req.session_id)

    def _decide(self, req: PlacementRequest, exclude: Exclude,
                binding: SessionBinding | None) -> tuple[Placement, SessionBinding | None]:
        cfg = self.config
        pp = self.view.pool("prefill", exclude) if cfg.prefill_pool else None
        dp = self.view.pool("decode", exclude)
        for role, pool in (("prefill", pp), ("decode", dp)):
            if pool is not None and not pool:
                self.metrics.no_workers.labels(pool=role).inc()
                raise NoWorkersAvailable(f"no healthy {role} worker (known: {len(self.view.workers)}, "
                                         f"excluded: {len(exclude)})")
        if cfg.policy == "round_robin":
            return self._simple(req, pp, dp, self._round_robin)
        if cfg.policy == "least_loaded":
            return self._simple(req, pp, dp, self._least_loaded)
        matches = self.index.match(req.block_hashes)
        moved_from = None
        kind = text = ""
        if binding is not None:
            kind, text = self._binding_usable(binding, exclude)
            if not kind:
                p = self.view.workers[binding.prefill_id] if binding.prefill_id else None
                d = self.view.workers[binding.decode_id]
                return self._placement(req, p, d, "session affinity", matches, session_hit=True), \
                    self._bind(req, p, d)
            moved_from = (binding.prefill_id, binding.decode_id)
        choice = self._choose(req, pp, dp, matches)
        p = self.view.workers[choice.prefill_id] if choice.prefill_id else None
        d = self.view.workers[choice.decode_id]
        reason = f"score {choice.cost * 1000:.2f}ms" + (" (load bound lifted: pool saturated)"
                                                        if choice.bounded else "")
        if moved_from is not None:
            # Even back onto the same ids (a restarted worker) this is a move: the KV it held is gone.
            reason = f"moved ({text}); " + reason
        # the cap the bounded-load rule applied (scoring.eligible), for the request's facts
        cap = 0 if choice.bounded else load_cap([c[1] for c in self.view.snapshot(dp)], self.config.epsilon)
        placement = self._placement(req, p, d, reason, matches, moved_from=moved_from, move_reason=text,
                                    move_kind=kind, score=choice.cost, load_cap=cap)
        return placement, self._bind(req, p, d)

    def _choose(self, req: PlacementRequest, pp: list[WorkerInfo] | None, dp: list[WorkerInfo],
                matches: dict[str, int]) -> PairChoice:
        """The cost model's best pair (see scoring.py for the terms)."""
        costs, view, bs, n = self.costs, self.view, self.config.block_size, req.prompt_len
        local = pp is None

        def tier_s(c: Candidate) -> float:
            """Loading the matched blocks the worker holds only in its host or disk tier."""
            host, disk = self.index.tier_split(c[0], req.block_hashes, c[2]) if c[2] else (0, 0)
            return costs.tier_load_s(c[0], host, disk)

        def prefill_cost(c: Candidate) -> float:
            cached = min(c[2] * bs, n)
            return (costs.queue_s(c[0], view.outstanding_tokens(c[0]), view.busy_for(c[0]))
                    + costs.prefill_s(c[0], n - cached, cached) + tier_s(c))

        def decode_cost(c: Candidate) -> float:
            if not local:
                # its tier blocks need no transfer (counted by choose_pair) but are loaded back
                return tier_s(c)
            # no prefill pool: it prefills what it does not hold itself, after its queued prefills
            return prefill_cost(c)

        return choose_pair(
            None if local else self._candidates(pp, matches), self._candidates(dp, matches),
            n_blocks=len(req.block_hashes), epsilon=self.config.epsilon, prefill_cost=prefill_cost,
            decode_cost=decode_cost, transfer_s=lambda p, d, blocks: costs.transfer_s(p, d, blocks * bs),
            measured_from=costs.links.measured_from, top_k=self.config.top_k,
            salt=req.block_hashes[0] & 0xFFFFFFFF if req.block_hashes else 0)

    def _binding_usable(self, b: SessionBinding, exclude: Exclude) -> tuple[str, str]:
        """``("", "")`` if the bound pair may serve the turn, else (kind, the sentence saying why)."""
        for wid, inc in ((b.prefill_id, b.prefill_incarnation), (b.decode_id, b.decode_incarnation)):
            if not wid:  # no prefill pool: the binding names a decode worker only
                if self.config.prefill_pool:
                    return "gone", "the session's prefill side is gone"
                continue
            if wid in exclude:
                return "excluded", f"{wid} excluded"
            w = self.view.workers.get(wid)
            if w is None:
                return "gone", f"{wid} gone"
            if w.incarnation != inc:
                return "restarted", f"{wid} restarted"
            if not self.view.healthy(wid):
                return "unhealthy", f"{wid} unhealthy"
            load = self.view.load_of(wid)
            others = [self.view.load_of(x.worker_id) for x in self.view.pool(w.role, exclude)
                      if x.worker_id != wid]
            if overloaded(load, others, self.config.session_epsilon, self.config.session_min_load):
                bound = session_bound(others, self.config.session_epsilon)
                return "overloaded", f"{wid} overloaded ({load} requests, bound {bound:.1f})"
        return "", ""

    def _candidates(self, pool: list[WorkerInfo], matches: dict[str, int]) -> list[Candidate]:
        return self.view.snapshot(pool, matches)

    def _bind(self, req: PlacementRequest, p: WorkerInfo | None, d: WorkerInfo) -> SessionBinding | None:
        if not (self.config.session_aware and req.session_id):
            return None
        return SessionBinding(prefill_id=p.worker_id if p else "",
                              prefill_incarnation=p.incarnation if p else "", decode_id=d.worker_id,
                              decode_incarnation=d.incarnation,
                              expires_at=self._wall() + self.config.session_ttl_s)

    def _simple(self, req, pp, dp, pick) -> tuple[Placement, SessionBinding | None]:
        p = pick(pp, "prefill") if pp is not None else None
        d = pick(dp, "decode")
        matches = self.index.match(req.block_hashes) if req.block_hashes else {}
        return self._placement(req, p, d, self.config.policy, matches), None

    def _round_robin(self, pool: list[WorkerInfo], role: str) -> WorkerInfo:
        w = pool[self._rr[role] % len(pool)]
        self._rr[role] += 1
        return w

    def _least_loaded(self, pool: list[WorkerInfo], role: str) -> WorkerInfo:
        n, start = len(pool), self._rr[role]
        self._rr[role] += 1
        best, best_key = 0, None
        for i, (_, load, _, free, total) in enumerate(self.view.snapshot(pool)):
            key = (load, -(free / total) if total > 0 and free >= 0 else -1.0, (i - start) % n)  # ties rotate
            if best_key is None or key < best_key:
                best, best_key = i, key
        return pool[best]

    def _placement(self, req, p, d, reason, matches, *, session_hit=False, moved_from=None,
                   move_reason="", move_kind="", score=0.0, load_cap=0) -> Placement:
        moved = moved_from is not None
        return Placement(prefill=p, decode=d, policy=self.config.policy, reason=reason,
                         session_hit=session_hit, session_moved=moved, moved_from=moved_from,
                         predicted_prefill_cached_blocks=matches.get(p.worker_id, 0) if p else 0,
                         predicted_decode_cached_blocks=matches.get(d.worker_id, 0), score=score,
                         move_reason=move_reason if moved else "", move_kind=move_kind if moved else "",
                         decode_load=self.view.load_of(d.worker_id) + 1, decode_load_cap=load_cap)

    def _commit(self, req: PlacementRequest, pl: Placement, binding: SessionBinding | None) -> None:
        p_id, d_id = pl.prefill_id, pl.decode.worker_id
        cached = min(pl.predicted_prefill_cached_blocks * self.config.block_size, req.prompt_len)
        self.view.begin(req.request_id, p_id or None, d_id, req.prompt_len - cached)
        limit = self._limit(req)
        if self.config.scored and limit:
            # Optimistic: a follower sharing this prompt's prefix should see it before the outcome
            # arrives. Only the next few blocks beyond what each side already holds, to bound the
            # cost of a decision; on_result adds the rest.
            hs, k = req.block_hashes, self.config.optimistic_blocks
            if p_id:
                start = pl.predicted_prefill_cached_blocks
                self.index.add(p_id, hs[start:min(limit, start + k)])
            start = pl.predicted_decode_cached_blocks
            self.index.add(d_id, hs[start:min(limit, start + k)])
        if binding is not None and req.session_id:
            self.sessions.put(req.session_id, binding)
        m = self.metrics
        if p_id:
            m.placed(pl.policy, "prefill", p_id).inc()
        m.placed(pl.policy, "decode", d_id).inc()
        m.prompt_tokens.inc(req.prompt_len)
        m.predicted_prefill.inc(pl.predicted_prefill_cached_blocks)
        m.predicted_decode.inc(pl.predicted_decode_cached_blocks)
        if pl.session_hit:
            m.affinity_hits.inc()
        if pl.session_moved:
            m.session_moves.labels(reason=pl.move_kind or "unknown").inc()

    # ---------------------------------------------------------------- outcomes
    def prefill_done(self, request_id: str, *, answered: bool = False, worker_id: str = "",
                     computed_tokens: int = 0, compute_s: float = 0.0, push_wait_s: float = -1.0) -> None:
        """The prompt left its worker's queue: ``answered`` (computed there; a local prefill's first
        token), or failed / cancelled. With a sample (``worker_id`` computed ``computed_tokens`` in
        ``compute_s``, then waited ``push_wait_s`` for its KV's acknowledgement; implies answered) the
        cost model learns that worker's rate, push wait and drain rate. Idempotent."""
        view = self.view
        if worker_id in view.workers and view.prefill_of(request_id) == worker_id:
            tokens = view.own_prefill_tokens(request_id)
            self.costs.observe_answer(worker_id, tokens, view.busy_for(worker_id))
        view.prefill_done(request_id, answered=answered or bool(worker_id))
        if worker_id in view.workers:
            self.costs.observe_prefill(worker_id, tokens=computed_tokens, compute_s=compute_s)
            self.costs.observe_push_wait(worker_id, push_wait_s)

    def on_result(self, req: PlacementRequest, placement: Placement, outcome: Outcome) -> None:
        self.view.end(req.request_id)
        p, d = placement.prefill, placement.decode
        m = self.metrics
        if outcome.fallback:
            m.fallbacks.labels(kind=outcome.fallback).inc()
        if not outcome.success:
            m.failures.inc()
            if outcome.failed_worker_id:
                self.view.mark_unhealthy(outcome.failed_worker_id)
                # What the failed side never produced must not attract the next request.
                limit = self._limit(req)
                start = (placement.predicted_prefill_cached_blocks
                         if p is not None and outcome.failed_worker_id == p.worker_id
                         else placement.predicted_decode_cached_blocks)
                self.index.remove(outcome.failed_worker_id, req.block_hashes[start:limit])
            return
        m.cache_hit_tokens.labels(pool="prefill").inc(outcome.prefill_cached_blocks * self.config.block_size)
        m.cache_hit_tokens.labels(pool="decode").inc(outcome.decode_cached_blocks * self.config.block_size)
        m.kv_bytes_sent.inc(outcome.bytes_sent)
        # Fencing: learn only about the incarnations that actually served the request.
        p_cur = self.view.workers.get(p.worker_id) if p is not None else None
        d_cur = self.view.workers.get(d.worker_id)
        p_ok = p_cur is not None and p_cur.incarnation == p.incarnation
        d_ok = d_cur is not None and d_cur.incarnation == d.incarnation
        if p_ok and outcome.prefill_block_hashes is not None:
            self.index.add(p.worker_id, outcome.prefill_block_hashes)
        if d_ok and outcome.decode_block_hashes is not None:
            self.index.add(d.worker_id, outcome.decode_block_hashes)
        if p_ok and d_ok:
            self.costs.observe_transfer(p.worker_id, d.worker_id, bytes_sent=outcome.bytes_sent,
                                        seconds=outcome.transfer_s, blocks_sent=outcome.blocks_sent)

    @property
    def inflight_total(self) -> int:
        return self.view.open_total

    def forget_request(self, request_id: str) -> None:
        """Close a placement that will never report back (e.g. the client went away before start)."""
        self.view.end(request_id)
