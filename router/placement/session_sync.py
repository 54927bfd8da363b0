"""SessionSync: the Placer's traffic with a shared store, kept off the decision's hot path.

- ``fetch`` / ``write``: the one or two store round trips ``aplace`` makes for a session turn,
  each bounded by ``store_timeout_s``. A failure returns a sentinel instead of raising, and the
  Placer decides from its local view (serving continues while Redis is down).
- ``refresh_later``: TTL refresh of an unchanged binding, fire-and-forget.
- A binding whose write failed (the store was down or timed out) is kept as unwritten and written
  again by the background task until the store takes it, so a store that comes back empty, or a
  replica that restarts, learns the bindings decided while it was away without waiting for each
  session's next turn; a later decision for the same session replaces the pending one.
- A background task (``start``) every ``sync_interval_s`` publishes load reports this replica
  received and pulls every worker's latest report, so all replicas see the same loads.
Store errors are counted in the ``redis_errors`` metric; reconnect/backoff is the store's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from router.metrics import RouterMetrics
from router.placement.config import PlacerConfig
from router.placement.types import WorkerLoad
from router.state.sessions import SessionBinding, SessionTable
from router.state.store import StateStore, StoreUnavailable
from router.state.workers import WorkerView

_STORE_ERRORS = (StoreUnavailable, asyncio.TimeoutError, OSError)


class SessionSync:
    """``store_counts_errors``: the store reports its own failures to the metrics (a RedisStore built
    with ``on_error``), so only what it cannot see is counted here."""

    def __init__(self, *, store: StateStore, config: PlacerConfig, view: WorkerView, sessions: SessionTable,
                 metrics: RouterMetrics, store_counts_errors: bool = False,
                 wall: Callable[[], float] = time.time) -> None:
        self.store, self.config, self.view, self.sessions = store, config, view, sessions
        self.metrics = metrics
        self.store_counts_errors = store_counts_errors
        self._wall = wall
        self._task: asyncio.Task | None = None
        self._bg: set[asyncio.Task] = set()
        self._loads_out: dict[str, WorkerLoad] = {}
        self._unwritten: dict[str, SessionBinding] = {}

    def _err(self, op: str, exc: BaseException | None = None) -> None:
        # A store with its own error hook counts its failures itself; here only what it cannot see:
        # our timeouts, and stores without a hook.
        if isinstance(exc, StoreUnavailable) and self.store_counts_errors:
            return
        self.metrics.redis_errors.labels(op=op).inc()

    async def fetch(self, session_id: str) -> SessionBinding | None | bool:
        """The store's binding, None if it has none, False if the store could not answer."""
        try:
            b = await asyncio.wait_for(self.store.get_session(session_id), self.config.store_timeout_s)
        except _STORE_ERRORS as e:
            self._err("get_session", e)
            return False
        if b is not None and b.expires_at <= self._wall():
            return None
        return b

    async def write(self, session_id: str, binding: SessionBinding, *, only_if_absent: bool) -> bool | None:
        """True/False as the store answered (False: set-if-absent lost), None if it could not answer:
        then the binding waits in ``unwritten`` for the background task (``_write_unwritten``)."""
        self._unwritten.pop(session_id, None)  # a newer decision replaces an older pending one
        self._unwritten[session_id] = binding
        while len(self._unwritten) > self.config.max_sessions:  # a long outage: the oldest go first
            del self._unwritten[next(iter(self._unwritten))]
        try:
            ok = await asyncio.wait_for(
                self.store.put_session(session_id, binding, self.config.session_ttl_s,
                                       only_if_absent=only_if_absent),
                self.config.store_timeout_s)
        except _STORE_ERRORS as e:
            self._err("put_session", e)
            return None
        if self._unwritten.get(session_id) is binding:
            del self._unwritten[session_id]
        return ok

    @property
    def unwritten(self) -> int:
        """Bindings decided while the store could not take them, not yet written."""
        return len(self._unwritten)

    async def _write_unwritten(self) -> None:
        now = self._wall()
        for sid, binding in list(self._unwritten.items()):
            if self._unwritten.get(sid) is not binding:
                continue  # replaced meanwhile by a newer decision (its own write is under way)
            if binding.expires_at <= now:
                del self._unwritten[sid]
                continue
            # The store's binding wins if it is newer (bindings carry their decision time plus the TTL
            # as expires_at): another replica decided after us. An older one (a store restored from a
            # snapshot taken before the outage) is replaced.
            current = await self.fetch(sid)
            if current is False:
                return  # still down: try again next round
            if isinstance(current, SessionBinding) and current.expires_at >= binding.expires_at:
                if self._unwritten.get(sid) is binding:
                    del self._unwritten[sid]
                continue
            if self._unwritten.get(sid) is not binding:
                continue  # a newer decision arrived while we asked
            if await self.write(sid, binding, only_if_absent=False) is None:
                return

    def refresh_later(self, session_id: str, binding: SessionBinding) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        t = loop.create_task(self.write(session_id, binding, only_if_absent=False))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def publish_load(self, worker_id: str, load: WorkerLoad) -> None:
        self._loads_out[worker_id] = load

    async def sync_once(self) -> None:
        cfg = self.config
        out, self._loads_out = self._loads_out, {}
        for wid, load in out.items():
            try:
                await asyncio.wait_for(self.store.put_load(wid, load, cfg.load_stale_s), 1.0)
            except _STORE_ERRORS as e:
                self._err("put_load", e)
                # Keep the newest unsent report for the next round unless a newer one arrived.
                self._loads_out.setdefault(wid, load)
        if self._unwritten:
            await self._write_unwritten()
        try:
            loads = await asyncio.wait_for(self.store.get_loads(), 1.0)
        except _STORE_ERRORS as e:
            self._err("get_loads", e)
            return
        view = self.view
        for wid, load in loads.items():
            mine = view.loads.get(wid)
            if mine is None or load.reported_at > mine.reported_at:
                view.set_load(wid, load)
        self.sessions.purge_expired()

    async def _loop(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self.config.sync_interval_s)

    async def start(self) -> None:
        if self.store.shared and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for t in list(self._bg):
            t.cancel()
        for t in list(self._bg):
            with contextlib.suppress(asyncio.CancelledError, *_STORE_ERRORS):
                await t
        with contextlib.suppress(Exception):
            await self.store.close()
