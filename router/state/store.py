"""StateStore: what router replicas (and workers) share: session bindings, worker leases, loads.

``InMemoryStore`` is the default (one router, nothing to install); ``RedisStore`` (redis_store.py)
has the same async methods and makes several replicas agree. Every method is a coroutine so the
grpc.aio router never blocks its event loop on the store; the Placer's hot path does not touch
the store at all except ``aplace``'s one session read.

Leases: ``register`` writes a worker's lease with a TTL; ``heartbeat`` refreshes it only while the
lease still belongs to the same incarnation (0 = lease gone: the worker must re-register, under a
new incarnation; -1 = another incarnation owns the id). An expired lease is never resurrected by
a late heartbeat, so an expired worker is never routed to under its old incarnation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Protocol

from router.placement.types import WorkerInfo, WorkerLoad
from router.state.sessions import SessionBinding


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached right now (callers keep serving from their local view)."""


def worker_to_json(w: WorkerInfo) -> str:
    return json.dumps(asdict(w), separators=(",", ":"))


def worker_from_json(raw: str | bytes) -> WorkerInfo:
    d = json.loads(raw)
    return WorkerInfo(worker_id=str(d["worker_id"]), role=str(d["role"]), address=str(d["address"]),
                      incarnation=str(d.get("incarnation", "")), layout_hash=str(d.get("layout_hash", "")))


def load_to_json(load: WorkerLoad) -> str:
    d = asdict(load)
    if not d["reported_at"]:
        d["reported_at"] = time.time()
    return json.dumps(d, separators=(",", ":"))


def load_from_json(raw: str | bytes) -> WorkerLoad:
    d = json.loads(raw)
    return WorkerLoad(queue_depth=int(d["queue_depth"]), num_running=int(d["num_running"]),
                      free_blocks=int(d["free_blocks"]), total_blocks=int(d["total_blocks"]),
                      incarnation=str(d.get("incarnation", "")), reported_at=float(d.get("reported_at", 0)))


class StateStore(Protocol):
    shared: bool
    # called with the operation's name whenever the store fails one (metrics); None = nobody counts
    on_error: Callable[[str], None] | None

    async def get_session(self, session_id: str) -> SessionBinding | None: ...
    async def put_session(self, session_id: str, binding: SessionBinding, ttl_s: float, *,
                          only_if_absent: bool = False) -> bool: ...
    async def delete_session(self, session_id: str) -> None: ...
    async def register(self, info: WorkerInfo, ttl_s: float) -> None: ...
    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> int: ...
    async def unregister(self, info: WorkerInfo) -> bool: ...
    async def list_workers(self) -> list[WorkerInfo]: ...
    async def put_load(self, worker_id: str, load: WorkerLoad, ttl_s: float) -> None: ...
    async def get_loads(self) -> dict[str, WorkerLoad]: ...
    async def close(self) -> None: ...


class InMemoryStore:
    """Process-local store with the same semantics (TTL, fencing) as RedisStore."""

    shared = False
    on_error = None  # it never fails

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._kv: dict[str, tuple[str, float]] = {}  # key -> (json, expires_at monotonic)

    def _get(self, key: str) -> str | None:
        v = self._kv.get(key)
        if v is None:
            return None
        if v[1] <= self._clock():
            del self._kv[key]
            return None
        return v[0]

    def _set(self, key: str, val: str, ttl_s: float) -> None:
        self._kv[key] = (val, self._clock() + ttl_s)

    async def get_session(self, session_id: str) -> SessionBinding | None:
        raw = self._get("session:" + session_id)
        return SessionBinding.from_json(raw) if raw else None

    async def put_session(self, session_id: str, binding: SessionBinding, ttl_s: float, *,
                          only_if_absent: bool = False) -> bool:
        key = "session:" + session_id
        if only_if_absent and self._get(key) is not None:
            return False
        self._set(key, binding.to_json(), ttl_s)
        return True

    async def delete_session(self, session_id: str) -> None:
        self._kv.pop("session:" + session_id, None)

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        self._set("worker:" + info.worker_id, worker_to_json(info), ttl_s)

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> int:
        raw = self._get("worker:" + info.worker_id)
        if raw is None:
            return 0
        if worker_from_json(raw).incarnation != info.incarnation:
            return -1
        self._set("worker:" + info.worker_id, raw, ttl_s)
        return 1

    async def unregister(self, info: WorkerInfo) -> bool:
        raw = self._get("worker:" + info.worker_id)
        if raw is None or worker_from_json(raw).incarnation != info.incarnation:
            return False
        del self._kv["worker:" + info.worker_id]
        return True

    async def list_workers(self) -> list[WorkerInfo]:
        out = []
        for key in sorted(k for k in list(self._kv) if k.startswith("worker:")):
            raw = self._get(key)
            if raw is not None:
                out.append(worker_from_json(raw))
        return out

    async def put_load(self, worker_id: str, load: WorkerLoad, ttl_s: float) -> None:
        self._set("load:" + worker_id, load_to_json(load), ttl_s)

    async def get_loads(self) -> dict[str, WorkerLoad]:
        out = {}
        for key in [k for k in list(self._kv) if k.startswith("load:")]:
            raw = self._get(key)
            if raw is not None:
                out[key[len("load:"):]] = load_from_json(raw)
        return out

    async def close(self) -> None:
        return None
