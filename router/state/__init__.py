"""Router state: the Placer's local views (prefix index, sessions, workers, links) and the shared store."""

from __future__ import annotations

from router.state.store import InMemoryStore, StateStore, StoreUnavailable

__all__ = ["InMemoryStore", "StateStore", "StoreUnavailable", "make_store"]


def make_store(redis_url: str | None = None, *, metrics=None, namespace: str = "pdserve") -> StateStore:
    """``--redis URL`` -> RedisStore (errors counted in ``metrics.redis_errors``), else InMemoryStore."""
    if not redis_url:
        return InMemoryStore()
    from router.state.redis_store import RedisStore

    on_error = (lambda op: metrics.redis_errors.labels(op=op).inc()) if metrics is not None else None
    return RedisStore(redis_url, namespace=namespace, on_error=on_error)
