"""PrefixIndex: the router's approximate picture of which KV blocks each worker holds.

Lifecycle: when the router places a request it optimistically ``add``s the request's reusable
block hashes to the chosen workers (so a burst sharing a prefix already sees it); ``on_result``
confirms with what the worker reported, or ``remove``s what a failed request never produced.
Each worker's entries are an LRU bounded by ``capacity`` blocks; a worker restarting under a new
incarnation, or leaving, is ``drop``ped whole. The index is a hint: a wrong guess costs a
recompute or a transfer, never a wrong answer, because the workers check hashes themselves.

Lookup exploits the chain: block i's hash covers blocks 0..i, so a worker "has the first n
blocks" exactly when it holds hash n-1 — matching walks the request's hashes once, keeping the
set of workers still matching, and stops when it is empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._lru.values())

    def workers(self) -> list[str]:
        return list(self._lru)

    def blocks_of(self, worker_id: str) -> int:
        lru = self._lru.get(worker_id)
        return len(lru) if lru else 0

    def add(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Insert/refresh ``hashes`` (a prefix chain, first block first). They are stamped last to
        first, so the LRU evicts a chain's tail before its head and what stays is still a prefix."""
        lru = self._lru.setdefault(worker_id, OrderedDict())
        holders = self._holders
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            holders.setdefault(h, set()).add(worker_id)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._unhold(old, worker_id)

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        lru = self._lru.get(worker_id)
        if not lru:
            return
        for h in hashes:
            if lru.pop(h, 0) is None:
                self._unhold(h, worker_id)

    def drop(self, worker_id: str) -> None:
        """Forget everything about a worker (it left, or restarted with an empty cache)."""
        lru = self._lru.pop(worker_id, None)
        if lru:
            for h in lru:
                self._unhold(h, worker_id)

    def _unhold(self, h: int, worker_id: str) -> None:
        s = self._holders.get(h)
        if s is not None:
            s.discard(worker_id)
            if not s:
                del self._holders[h]

    def match(self, hashes: Sequence[int], limit: int | None = None) -> dict[str, int]:
        """Leading blocks of ``hashes`` (at most ``limit``) each worker holds; absent = 0."""
        n = len(hashes) if limit is None else min(limit, len(hashes))
        if n == 0:
            return {}
        holders = self._holders
        first = holders.get(hashes[0])
        if not first:
            return {}
        alive = set(first)
        out: dict[str, int] = {}
        for i in range(1, n):
            s = holders.get(hashes[i])
            if s is None:
                for w in alive:
                    out[w] = i
                return out
            if not alive <= s:
                gone = alive - s
                for w in gone:
                    out[w] = i
                alive -= gone
                if not alive:
                    return out
        for w in alive:
            out[w] = n
        return out

    def touch(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Mark blocks recently used (a hit keeps them from LRU eviction on the router's side too)."""
        lru = self._lru.get(worker_id)
        if lru:
            for h in reversed(hashes):
                if h in lru:
                    lru.move_to_end(h)
