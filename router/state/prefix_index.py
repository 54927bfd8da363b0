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

Tiers: each entry records which of a worker's tiers hold the block (``DEVICE``, ``HOST``, ``DISK``
bits). The workers' cache events (``apply``) set and clear them; what placement adds optimistically is
a device block. ``match`` counts a block held in any tier; ``tier_split`` says how many of a matched
prefix would come from the host or disk tier, which placement charges at their load cost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEVICE, HOST, DISK = 1, 2, 4
TIER_BITS = {"device": DEVICE, "host": HOST, "disk": DISK}


class PrefixIndex:
    """Holders of a block are a bitmask of worker slots (an int, not a set): matching is a few
    integer ANDs per block, and millions of entries add no containers for the garbage collector
    to walk (which would show up as latency spikes in routing decisions)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._holders: dict[int, int] = {}  # block hash -> bitmask of worker slots
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._slot: dict[str, int] = {}  # worker id -> bit position
        self._by_slot: list[str | None] = []
        self._free_slots: list[int] = []

    def __len__(self) -> int:
        return sum(len(v) for v in self._lru.values())

    def workers(self) -> list[str]:
        return list(self._lru)

    def blocks_of(self, worker_id: str) -> int:
        lru = self._lru.get(worker_id)
        return len(lru) if lru else 0

    def _bit(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._by_slot[slot] = worker_id
            else:
                slot = len(self._by_slot)
                self._by_slot.append(worker_id)
            self._slot[worker_id] = slot
        return 1 << slot

    def add(self, worker_id: str, hashes: Sequence[int], tier: int = DEVICE) -> None:
        """Insert/refresh ``hashes`` (a prefix chain, first block first) as held in ``tier``. They are
        stamped last to first, so the LRU evicts a chain's tail before its head and what stays is
        still a prefix."""
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
        bit = self._bit(worker_id)
        holders = self._holders
        for h in reversed(hashes):
            tiers = lru.get(h)
            if tiers is not None:
                lru[h] = tiers | tier
                lru.move_to_end(h)
                continue
            lru[h] = tier
            holders[h] = holders.get(h, 0) | bit
        if len(lru) > self.capacity:
            keep = ~bit
            while len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                m = holders.get(old, 0) & keep
                if m:
                    holders[old] = m
                else:
                    holders.pop(old, None)

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        lru = self._lru.get(worker_id)
        if not lru:
            return
        for h in hashes:
            if lru.pop(h, None) is not None:
                self._unhold(h, worker_id)

    def apply(self, worker_id: str, tier: str, stored: bool, hashes: Sequence[int]) -> None:
        """A worker's cache event: ``hashes`` became reusable in ``tier`` (stored) or stopped being."""
        bit = TIER_BITS[tier]
        if stored:
            self.add(worker_id, hashes, bit)
            return
        lru = self._lru.get(worker_id)
        if not lru:
            return
        for h in hashes:
            tiers = lru.get(h)
            if tiers is None:
                continue
            if tiers & ~bit:
                lru[h] = tiers & ~bit
            else:
                del lru[h]
                self._unhold(h, worker_id)

    def tier_split(self, worker_id: str, hashes: Sequence[int], n: int) -> tuple[int, int]:
        """Of the first ``n`` of ``hashes`` (held by ``worker_id``), how many only its host tier holds
        and how many only its disk tier (the rest are in its device cache)."""
        lru = self._lru.get(worker_id)
        host = disk = 0
        if lru:
            for h in hashes[:n]:
                tiers = lru.get(h, DEVICE)
                if not tiers & DEVICE:
                    if tiers & HOST:
                        host += 1
                    else:
                        disk += 1
        return host, disk

    def drop(self, worker_id: str) -> None:
        """Forget everything about a worker (it left, or restarted with an empty cache)."""
        lru = self._lru.pop(worker_id, None)
        if lru:
            for h in lru:
                self._unhold(h, worker_id)
        slot = self._slot.pop(worker_id, None)
        if slot is not None:
            self._by_slot[slot] = None
            self._free_slots.append(slot)

    def _unhold(self, h: int, worker_id: str) -> None:
        m = self._holders.get(h)
        if m is not None:
            m &= ~(1 << self._slot[worker_id])
            if m:
                self._holders[h] = m
            else:
                del self._holders[h]

    def _emit(self, bits: int, n: int, out: dict[str, int]) -> None:
        by_slot = self._by_slot
        while bits:
            low = bits & -bits
            out[by_slot[low.bit_length() - 1]] = n
            bits ^= low

    def match(self, hashes: Sequence[int], limit: int | None = None) -> dict[str, int]:
        """Leading blocks of ``hashes`` (at most ``limit``) each worker holds; absent = 0."""
        n = len(hashes) if limit is None else min(limit, len(hashes))
        if n == 0:
            return {}
        get = self._holders.get
        alive = get(hashes[0], 0)
        if not alive:
            return {}
        out: dict[str, int] = {}
        for i in range(1, n):
            nxt = alive & get(hashes[i], 0)
            if nxt != alive:
                self._emit(alive ^ nxt, i, out)
                if not nxt:
                    return out
                alive = nxt
        self._emit(alive, n, out)
        return out

    def touch(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Mark blocks recently used (a hit keeps them from LRU eviction on the router's side too)."""
        lru = self._lru.get(worker_id)
        if lru:
            for h in reversed(hashes):
                if h in lru:
                    lru.move_to_end(h)
