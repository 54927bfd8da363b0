"""Placer: the router's placement brain.

Lifecycle of one request:

1. ``place(req)`` (sync, no I/O) or ``await aplace(req)`` (reads the session binding from the
   shared store first, so router replicas agree). Decision by policy:
   - ``round_robin`` / ``least_loaded``: each pool on its own.
   - ``prefix``: the best (prefill, decode) *pair* by estimated time-to-first-token, under the
     bounded-load rule (scoring.py).
   - ``session+prefix``: a session's bound pair while both are current (same incarnation),
     healthy, not excluded and not overloaded; otherwise score as ``prefix`` and move the binding,
     reporting ``session_moved`` and ``moved_from``.
   The decision is then *committed*: in-flight counts go up, the request's reusable blocks are
   optimistically added to both workers' entries in the prefix index, the binding is refreshed.
2. The servicer runs the request and calls ``on_result(req, placement, outcome)``: in-flight
   counts go down, the index learns what the workers really hold, link bandwidth and KV block
   size are measured, a failed worker is marked unhealthy for a cooldown.
3. Membership comes from discovery through ``update_workers``: a worker that left or came back
   under a new incarnation loses everything learnt about it; bindings naming an old incarnation
   are dead (the session moves on its next turn). ``update_load`` feeds queue/KV reports.

With a shared store (Redis) ``start()`` runs a background task that publishes this replica's
load reports and pulls everyone's; if the store is down the Placer keeps deciding from its last
view and the store reconnects with capped backoff (redis_store.py).
"""

from __future__ import annotations

import dataclasses
import time

from router.metrics import RouterMetrics
from router.placement.config import PlacerConfig
from router.placement.scoring import Candidate, choose_pair, overloaded
from router.placement.session_sync import SessionSync
from router.placement.types import (
    NoWorkersAvailable,
    Outcome,
    Placement,
    PlacementRequest,
    WorkerInfo,
    WorkerLoad,
)
from router.state.bandwidth import LinkStats
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
        if hasattr(self.store, "_on_error") and self.store._on_error is None:
            self.store._on_error = lambda op: self.metrics.redis_errors.labels(op=op).inc()
        self._wall = wall
        self.view = WorkerView(unhealthy_cooldown_s=cfg.unhealthy_cooldown_s, load_stale_s=cfg.load_stale_s,
                               clock=clock, wall=wall)
        self.index = PrefixIndex(cfg.index_blocks_per_worker)
        self.sessions = SessionTable(cfg.max_sessions, clock=wall)
        self.links = LinkStats(default_Bps=cfg.default_bandwidth_Bps, alpha=cfg.bandwidth_ewma_alpha,
                               min_sample_bytes=cfg.min_bandwidth_sample_bytes,
                               bytes_per_block=cfg.kv_bytes_per_block)
        self._rr = {"prefill": 0, "decode": 0}
        self._pending: dict[str, tuple[str, str]] = {}  # request_id -> (prefill_id, decode_id)
        self._sync = SessionSync(self)

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
            self.links.forget(wid)
        for role in ("prefill", "decode"):
            self.metrics.workers.labels(pool=role).set(sum(1 for w in self.view.workers.values()
                                                           if w.role == role))

    def update_load(self, worker_id: str, load: WorkerLoad) -> None:
        if not load.reported_at:
            load = dataclasses.replace(load, reported_at=self._wall())
        if self.view.set_load(worker_id, load) and self.store.shared:
            self._sync.publish_load(worker_id, load)

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
        pp = self.view.pool("prefill", exclude)
        dp = self.view.pool("decode", exclude)
        for role, pool in (("prefill", pp), ("decode", dp)):
            if not pool:
                self.metrics.no_workers.labels(pool=role).inc()
                raise NoWorkersAvailable(f"no healthy {role} worker (known: {len(self.view.workers)}, "
                                         f"excluded: {len(exclude)})")
        if cfg.policy == "round_robin":
            return self._simple(req, pp, dp, "round_robin", self._round_robin)
        if cfg.policy == "least_loaded":
            return self._simple(req, pp, dp, "least_loaded", self._least_loaded)
        matches = self.index.match(req.block_hashes)
        moved_from = None
        move_reason = ""
        if binding is not None:
            keep, move_reason = self._binding_usable(binding, exclude)
            if keep:
                p = self.view.workers[binding.prefill_id]
                d = self.view.workers[binding.decode_id]
                return self._placement(req, p, d, "session affinity", matches, session_hit=True), \
                    self._bind(req, p, d)
            moved_from = (binding.prefill_id, binding.decode_id)
        choice = choose_pair(
            self._candidates(pp, matches), self._candidates(dp, matches),
            n_blocks=len(req.block_hashes), prompt_len=req.prompt_len, block_size=cfg.block_size,
            epsilon=cfg.epsilon, prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            queue_cost_s=cfg.queue_cost_s, kv_pressure_cost_s=cfg.kv_pressure_cost_s,
            bytes_per_block=self.links.bytes_per_block, default_bw=cfg.default_bandwidth_Bps,
            bandwidth_rows=self.links.rows, top_k=cfg.top_k,
            salt=req.block_hashes[0] & 0xFFFFFFFF if req.block_hashes else 0)
        p = self.view.workers[choice.prefill_id]
        d = self.view.workers[choice.decode_id]
        reason = f"score {choice.cost * 1000:.2f}ms" + (" (load bound lifted: pool saturated)"
                                                        if choice.bounded else "")
        if moved_from is not None:
            # Even back onto the same ids (a restarted worker) this is a move: the KV it held is gone.
            reason = f"moved ({move_reason}); " + reason
        placement = self._placement(req, p, d, reason, matches, moved_from=moved_from,
                                    move_reason=move_reason, score=choice.cost)
        return placement, self._bind(req, p, d) if cfg.session_aware and req.session_id else None

    def _binding_usable(self, b: SessionBinding, exclude: Exclude) -> tuple[bool, str]:
        for wid, inc in ((b.prefill_id, b.prefill_incarnation), (b.decode_id, b.decode_incarnation)):
            if wid in exclude:
                return False, f"{wid} excluded"
            w = self.view.workers.get(wid)
            if w is None:
                return False, f"{wid} gone"
            if w.incarnation != inc:
                return False, f"{wid} restarted"
            if not self.view.healthy(wid):
                return False, f"{wid} unhealthy"
            pool = self.view.pool(w.role, exclude)
            load = self.view.load_of(wid)
            if overloaded(load, [self.view.load_of(x.worker_id) for x in pool], self.config.session_epsilon,
                          self.config.session_min_load):
                return False, f"{wid} overloaded"
        return True, ""

    def _candidates(self, pool: list[WorkerInfo], matches: dict[str, int]) -> list[Candidate]:
        return self.view.snapshot(pool, matches)

    def _bind(self, req: PlacementRequest, p: WorkerInfo, d: WorkerInfo) -> SessionBinding | None:
        if not (self.config.session_aware and req.session_id):
            return None
        return SessionBinding(prefill_id=p.worker_id, prefill_incarnation=p.incarnation,
                              decode_id=d.worker_id, decode_incarnation=d.incarnation,
                              expires_at=self._wall() + self.config.session_ttl_s)

    def _simple(self, req, pp, dp, policy, pick) -> tuple[Placement, SessionBinding | None]:
        p, d = pick(pp, "prefill"), pick(dp, "decode")
        matches = self.index.match(req.block_hashes) if req.block_hashes else {}
        return self._placement(req, p, d, policy, matches), None

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
                   move_reason="", score=0.0) -> Placement:
        return Placement(prefill=p, decode=d, policy=self.config.policy, reason=reason,
                         session_hit=session_hit, session_moved=moved_from is not None,
                         moved_from=moved_from, predicted_prefill_cached_blocks=matches.get(p.worker_id, 0),
                         predicted_decode_cached_blocks=matches.get(d.worker_id, 0), score=score,
                         move_reason=move_reason if moved_from is not None else "")

    def _commit(self, req: PlacementRequest, pl: Placement, binding: SessionBinding | None) -> None:
        p_id, d_id = pl.prefill.worker_id, pl.decode.worker_id
        old = self._pending.pop(req.request_id, None)
        if old is not None:  # a retry of a request whose first placement never reported back
            self.view.add_inflight(old[0], -1)
            self.view.add_inflight(old[1], -1)
        self._pending[req.request_id] = (p_id, d_id)
        self.view.add_inflight(p_id, 1)
        self.view.add_inflight(d_id, 1)
        limit = self._limit(req)
        if self.config.policy in ("prefix", "session+prefix") and limit:
            # Optimistic: a follower sharing this prompt's prefix should see it before the outcome
            # arrives. Only the next few blocks beyond what each side already holds, to bound the
            # cost of a decision; on_result adds the rest.
            hs, k = req.block_hashes, self.config.optimistic_blocks
            start = pl.predicted_prefill_cached_blocks
            self.index.add(p_id, hs[start:min(limit, start + k)])
            start = pl.predicted_decode_cached_blocks
            self.index.add(d_id, hs[start:min(limit, start + k)])
        if binding is not None and req.session_id:
            self.sessions.put(req.session_id, binding)
        m = self.metrics
        m.placed(pl.policy, "prefill", p_id).inc()
        m.placed(pl.policy, "decode", d_id).inc()
        m.prompt_tokens.inc(req.prompt_len)
        m.predicted_prefill.inc(pl.predicted_prefill_cached_blocks)
        m.predicted_decode.inc(pl.predicted_decode_cached_blocks)
        if pl.session_hit:
            m.affinity_hits.inc()
        if pl.session_moved:
            m.session_moves.labels(reason=pl.move_reason.rsplit(" ", 1)[-1] or "unknown").inc()

    # ---------------------------------------------------------------- outcomes
    def on_result(self, req: PlacementRequest, placement: Placement, outcome: Outcome) -> None:
        pend = self._pending.pop(req.request_id, None)
        if pend is not None:
            self.view.add_inflight(pend[0], -1)
            self.view.add_inflight(pend[1], -1)
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
                start = (placement.predicted_prefill_cached_blocks if outcome.failed_worker_id == p.worker_id
                         else placement.predicted_decode_cached_blocks)
                self.index.remove(outcome.failed_worker_id, req.block_hashes[start:limit])
            return
        m.cache_hit_tokens.labels(pool="prefill").inc(outcome.prefill_cached_blocks * self.config.block_size)
        m.cache_hit_tokens.labels(pool="decode").inc(outcome.decode_cached_blocks * self.config.block_size)
        m.kv_bytes_sent.inc(outcome.bytes_sent)
        # Fencing: learn only about the incarnations that actually served the request.
        p_cur = self.view.workers.get(p.worker_id)
        d_cur = self.view.workers.get(d.worker_id)
        if p_cur is not None and p_cur.incarnation == p.incarnation:
            if outcome.prefill_block_hashes is not None:
                self.index.add(p.worker_id, outcome.prefill_block_hashes)
        if d_cur is not None and d_cur.incarnation == d.incarnation:
            if outcome.decode_block_hashes is not None:
                self.index.add(d.worker_id, outcome.decode_block_hashes)
        if p_cur is not None and d_cur is not None:
            self.links.observe(p.worker_id, d.worker_id, bytes_sent=outcome.bytes_sent,
                               seconds=outcome.transfer_s, blocks_sent=outcome.blocks_sent)

    @property
    def inflight_total(self) -> int:
        return len(self._pending)

    def forget_request(self, request_id: str) -> None:
        """Drop a placement that will never report back (e.g. the client went away before start)."""
        pend = self._pending.pop(request_id, None)
        if pend is not None:
            self.view.add_inflight(pend[0], -1)
            self.view.add_inflight(pend[1], -1)
