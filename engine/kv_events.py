"""``KVEvents``: what a worker's KV cache gains and loses, by tier, for the router's prefix index.

A block hash that becomes reusable in a tier is *stored* there (``device``: registered in the paged
cache; ``host``: offloaded to host memory; ``disk``: written to the disk tier); one that stops being
reusable there is *removed* (evicted, dropped, or failed its check). This is the stream llm-d's and
Dynamo's routers read from vLLM and SGLang as "KV events": placement follows what workers really hold
instead of guessing.

Events are numbered one per hash, from 1. Producers (the engine thread, the disk writer thread) append
under a lock; consecutive events of one tier and kind share a batch. The log keeps the newest
``capacity`` hashes' worth: a reader asks for the events after the number it last saw (``since``) and,
when those have been trimmed, or it saw nothing yet (a router that just started), takes a snapshot of
what the worker holds now instead (the engine's ``cache_snapshot``) and then the events after the
number read before the snapshot. Applying events in order on top of such a snapshot gives the
worker's picture: every event is a set operation, and one that the snapshot already reflects
changes nothing when applied again.
"""

from __future__ import annotations

import threading
from collections import deque


class KVEvents:
    def __init__(self, capacity: int = 262_144) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        # [number of the batch's first event, tier, stored, hashes]
        self._batches: deque[list] = deque()
        self._last = 0  # number of the newest event
        self._held = 0  # events in _batches

    @property
    def last(self) -> int:
        return self._last

    def stored(self, tier: str, hashes: list[int]) -> None:
        self._add(tier, True, hashes)

    def removed(self, tier: str, hashes: list[int]) -> None:
        self._add(tier, False, hashes)

    def _add(self, tier: str, stored: bool, hashes: list[int]) -> None:
        if not hashes:
            return
        with self._lock:
            tail = self._batches[-1] if self._batches else None
            if tail is not None and tail[1] == tier and tail[2] == stored:
                tail[3].extend(hashes)
            else:
                self._batches.append([self._last + 1, tier, stored, list(hashes)])
            self._last += len(hashes)
            self._held += len(hashes)
            while self._held > self.capacity and len(self._batches) > 1:
                first = self._batches.popleft()
                self._held -= len(first[3])

    def since(self, after: int, limit: int) -> tuple[int, list[tuple[str, bool, list[int]]]] | None:
        """``(number of the last event returned, [(tier, stored, hashes), ...])``: at most about ``limit``
        events after ``after``; None when some of them are no longer kept (take a snapshot)."""
        with self._lock:
            if after > self._last:
                return None  # numbers from another log (a reader confused about incarnations)
            oldest = self._batches[0][0] if self._batches else self._last + 1
            if after + 1 < oldest:
                return None
            out, upto = [], after
            for first, tier, stored, hashes in self._batches:
                end = first + len(hashes) - 1
                if end <= after:
                    continue
                start = max(after + 1, first) - first
                take = hashes[start:start + max(limit - (upto - after), 0)]
                if not take:
                    break
                out.append((tier, stored, take))
                upto = first + start + len(take) - 1
            return upto, out
