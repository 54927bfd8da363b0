"""StaticDiscovery: a fixed worker list from ``--prefill`` / ``--decode`` (comma-separated)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from router.placement.types import WorkerInfo


def parse_static(role: str, spec: str | list[str]) -> list[WorkerInfo]:
    """``"host:port,host:port"`` or ``["id=host:port", ...]`` -> workers; the id defaults to role@addr.

    A static worker has no incarnation (""), so restarts are invisible: fine for development;
    use Redis leases or Kubernetes when workers restart under you.
    """
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s and s.strip()]
    out = []
    for item in items:
        wid, _, addr = item.rpartition("=")
        if not addr or ":" not in addr:
            raise ValueError(f"--{role} entry {item!r} is not host:port or id=host:port")
        out.append(WorkerInfo(worker_id=wid or f"{role}@{addr}", role=role, address=addr))
    return out


class StaticDiscovery:
    def __init__(self, *, prefill: str | list[str] = "", decode: str | list[str] = "") -> None:
        self.workers = parse_static("prefill", prefill) + parse_static("decode", decode)
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate worker ids in the static lists: {ids}")

    def current(self) -> list[WorkerInfo]:
        return list(self.workers)

    async def run(self, on_update: Callable[[list[WorkerInfo]], None]) -> None:
        on_update(self.current())
        await asyncio.Event().wait()  # nothing ever changes; run until cancelled
