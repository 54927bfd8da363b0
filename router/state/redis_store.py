"""RedisStore: the StateStore shared by router replicas and workers, over ``redis.asyncio``.

Keys (``ns`` defaults to ``pdserve``; see docs/router.md):

    {ns}:session:{session_id}  binding JSON            TTL = session TTL, refreshed every turn
    {ns}:worker:{worker_id}    lease JSON (WorkerInfo) TTL = lease TTL, refreshed by heartbeat
    {ns}:workers               SET of worker ids       index for listing; pruned when a lease is gone
    {ns}:load:{worker_id}      load JSON               TTL = load TTL
    {ns}:loads                 SET of worker ids       index of load reports; pruned likewise

Availability: redis-py's own retries are switched off and every command has short socket
timeouts, so a dead Redis costs one fast failure, never a stalled event loop. After a failure the
store is *down* for a backoff window (capped exponential, 50 ms doubling to 5 s, with jitter)
during which calls fail immediately with StoreUnavailable; the first call after the window tries
Redis again (redis-py reconnects on its own) and a success resets the backoff. Callers keep
serving from their local view while it is down.
"""

from __future__ import annotations

import asyncio
import random
import time

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from router.placement.types import WorkerInfo, WorkerLoad
from router.state.sessions import SessionBinding
from router.state.store import (
    StoreUnavailable,
    load_from_json,
    load_to_json,
    worker_from_json,
    worker_to_json,
)

# Refresh the lease only if it still holds our incarnation; never resurrect an expired one.
_HEARTBEAT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, cur = pcall(cjson.decode, raw)
if not ok or cur['incarnation'] ~= ARGV[1] then return -1 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""
_UNREGISTER = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, cur = pcall(cjson.decode, raw)
if not ok or cur['incarnation'] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""


class RedisStore:
    shared = True

    def __init__(self, url: str, *, namespace: str = "pdserve", socket_timeout_s: float = 0.25,
                 backoff_base_s: float = 0.05, backoff_max_s: float = 5.0, on_error=None) -> None:
        if backoff_base_s <= 0 or backoff_max_s < backoff_base_s:
            raise ValueError("need 0 < backoff_base_s <= backoff_max_s")
        self.url = url
        self.ns = namespace
        self.socket_timeout_s = socket_timeout_s
        self._r = aredis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._hb = self._r.register_script(_HEARTBEAT)
        self._unreg = self._r.register_script(_UNREGISTER)
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._failures = 0
        self._down_until = 0.0
        self.errors = 0
        self.reconnects = 0
        self.on_error = on_error  # callback(op: str) for metrics

    # --- availability gate -------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._failures == 0

    def _gate(self) -> None:
        if self._failures and time.monotonic() < self._down_until:
            wait = self._down_until - time.monotonic()
            raise StoreUnavailable(f"redis {self.url} down; next try in {wait:.2f}s")

    def _ok(self) -> None:
        if self._failures:
            self.reconnects += 1
        self._failures = 0

    def _fail(self, op: str, exc: Exception) -> StoreUnavailable:
        self._failures += 1
        self.errors += 1
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** (self._failures - 1))
        self._down_until = time.monotonic() + delay * random.uniform(0.5, 1.0)
        if self.on_error is not None:
            self.on_error(op)
        return StoreUnavailable(f"redis {op} failed: {exc}")

    async def _call(self, op: str, coro_fn, *args, **kwargs):
        self._gate()
        try:
            out = await coro_fn(*args, **kwargs)
        except (RedisError, OSError) as e:
            raise self._fail(op, e) from e
        self._ok()
        return out

    def _k(self, kind: str, ident: str) -> str:
        return f"{self.ns}:{kind}:{ident}"

    # --- sessions ------------------------------------------------------------------------------
    async def get_session(self, session_id: str) -> SessionBinding | None:
        raw = await self._call("get_session", self._r.get, self._k("session", session_id))
        return SessionBinding.from_json(raw) if raw else None

    async def put_session(self, session_id: str, binding: SessionBinding, ttl_s: float, *,
                          only_if_absent: bool = False) -> bool:
        ok = await self._call("put_session", self._r.set, self._k("session", session_id), binding.to_json(),
                              px=max(1, int(ttl_s * 1000)), nx=only_if_absent)
        return bool(ok)

    async def delete_session(self, session_id: str) -> None:
        await self._call("delete_session", self._r.delete, self._k("session", session_id))

    # --- worker leases -----------------------------------------------------------------------
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        async def _do():
            async with self._r.pipeline(transaction=True) as p:
                p.set(self._k("worker", info.worker_id), worker_to_json(info), px=max(1, int(ttl_s * 1000)))
                p.sadd(f"{self.ns}:workers", info.worker_id)
                await p.execute()
        await self._call("register", _do)

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> int:
        keys = [self._k("worker", info.worker_id), f"{self.ns}:workers"]
        args = [info.incarnation, max(1, int(ttl_s * 1000)), info.worker_id]
        return int(await self._call("heartbeat", self._hb, keys=keys, args=args))

    async def unregister(self, info: WorkerInfo) -> bool:
        return bool(await self._call(
            "unregister", self._unreg, keys=[self._k("worker", info.worker_id), f"{self.ns}:workers"],
            args=[info.incarnation, info.worker_id]))

    async def list_workers(self) -> list[WorkerInfo]:
        ids = sorted(await self._call("list_workers", self._r.smembers, f"{self.ns}:workers"))
        if not ids:
            return []
        raws = await self._call("list_workers", self._r.mget, [self._k("worker", i) for i in ids])
        out, gone = [], []
        for wid, raw in zip(ids, raws, strict=True):
            if raw is None:
                gone.append(wid)
                continue
            try:
                out.append(worker_from_json(raw))
            except (ValueError, KeyError, TypeError):
                continue  # a malformed lease is nobody's lease
        if gone:
            # A lease that expired between SMEMBERS and now may be re-registered concurrently; SREM of
            # an id whose key exists again is harmless because heartbeat re-adds it to the set.
            await self._call("list_workers", self._r.srem, f"{self.ns}:workers", *gone)
        return out

    # --- loads -------------------------------------------------------------------------------
    async def put_load(self, worker_id: str, load: WorkerLoad, ttl_s: float) -> None:
        async def _do():
            async with self._r.pipeline(transaction=True) as p:
                p.set(self._k("load", worker_id), load_to_json(load), px=max(1, int(ttl_s * 1000)))
                p.sadd(f"{self.ns}:loads", worker_id)
                await p.execute()
        await self._call("put_load", _do)

    async def get_loads(self) -> dict[str, WorkerLoad]:
        ids = sorted(await self._call("get_loads", self._r.smembers, f"{self.ns}:loads"))
        if not ids:
            return {}
        raws = await self._call("get_loads", self._r.mget, [self._k("load", i) for i in ids])
        out = {}
        gone = [wid for wid, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            await self._call("get_loads", self._r.srem, f"{self.ns}:loads", *gone)
        for wid, raw in zip(ids, raws, strict=True):
            if raw is not None:
                try:
                    out[wid] = load_from_json(raw)
                except (ValueError, KeyError, TypeError):
                    continue
        return out

    async def close(self) -> None:
        # Bounded: a router shutting down must not wait on a half-open socket to a dead Redis.
        try:
            await asyncio.wait_for(self._r.aclose(), max(1.0, 4 * self.socket_timeout_s))
        except (RedisError, OSError, asyncio.TimeoutError):
            pass
