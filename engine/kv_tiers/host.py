"""The host-memory KV tier: a fixed pool of block slots in (pinned, on CUDA) host memory, LRU by hash.

Lifecycle of a slot::

    free ──reserve(hash)──▶ being written ──written──▶ held (hash → slot, LRU)
                                                      │   ▲
                                 pin (a load reads it)│   │unpin
                                                      ▼   │
                                                     pinned

    A reserve with no free slot evicts the least recently used held, unpinned slot: its bytes go to
    ``on_evict`` (the disk tier) before the slot is reused. A slot being written is pinned, so a batch
    of offloads never evicts its own unwritten slots, and loads do not see it until it is written.

One slot holds one KV block of every layer, ``[num_layers, 2, block_size, num_kv_heads, head_dim]``,
contiguous, so a block leaves for disk or comes back as one piece. The pool is allocated once at its
full size (``capacity`` slots), which is what bounds the tier's memory to its setting.

Thread safety: the engine thread puts (offload) and the load thread pins, reads and unpins; every
index change holds ``lock``. A pinned slot is never evicted or overwritten, so a load reads stable
bytes without holding the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.kv_layout import KVLayout


class HostTier:
    """``capacity`` block slots of ``layout`` in host memory (pinned when ``pin_memory``)."""

    def __init__(self, layout: KVLayout, capacity: int, *, pin_memory: bool,
                 on_evict: Callable[[int, torch.Tensor], None] | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {capacity}")
        self.layout = layout
        self.capacity = capacity
        shape = (capacity, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.slots = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin_memory)
        self.lock = threading.Lock()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self._pins = [0] * capacity
        self._pending: dict[int, object] = {}  # slot -> CUDA event of the copy still writing it
        self._unwritten: set[int] = set()  # reserved, not yet written
        self.on_evict = on_evict
        self.evictions = 0
        self.events = None  # engine.kv_events.KVEvents ("host" tier)

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: int) -> bool:
        slot = self._slot_of.get(block_hash)
        return slot is not None and slot not in self._unwritten

    def touch(self, block_hash: int) -> None:
        """Mark ``block_hash`` most recently used (it left the device cache again)."""
        with self.lock:
            if block_hash in self._slot_of:
                self._slot_of.move_to_end(block_hash)

    def reserve(self, block_hash: int) -> int | None:
        """A slot to write ``block_hash`` into (the caller copies, then ``written``); None when it is
        already held or every slot is pinned. Evicts the least recently used slot when none is free,
        handing its bytes to ``on_evict`` first."""
        with self.lock:
            if block_hash in self._slot_of:
                self._slot_of.move_to_end(block_hash)
                return None
            if self._free:
                slot = self._free.pop()
            else:
                victim = next((h for h, s in self._slot_of.items() if self._pins[s] == 0), None)
                if victim is None:
                    return None
                slot = self._slot_of.pop(victim)
                self.evictions += 1
                self._wait_written(slot)
                if self.on_evict is not None:
                    self.on_evict(victim, self.slots[slot])
                if self.events is not None:
                    self.events.removed("host", [victim])
            self._slot_of[block_hash] = slot
            if self.events is not None:
                self.events.stored("host", [block_hash])
            self._pins[slot] = 1
            self._unwritten.add(slot)
            return slot

    def written(self, slots: list[int], event=None) -> None:
        """The reserved ``slots`` are written; with ``event`` (a CUDA event), once it completes."""
        with self.lock:
            for slot in slots:
                self._unwritten.discard(slot)
                self._pins[slot] -= 1
                if event is not None:
                    self._pending[slot] = event

    def _wait_written(self, slot: int) -> None:
        event = self._pending.pop(slot, None)
        if event is not None:
            event.synchronize()

    def pin(self, hashes: list[int]) -> list[int]:
        """Slots of the leading ``hashes`` held here, pinned against eviction until ``unpin``; stops at
        the first hash not held. Touches them (most recently used)."""
        out = []
        with self.lock:
            for h in hashes:
                slot = self._slot_of.get(h)
                if slot is None or slot in self._unwritten:
                    break
                self._slot_of.move_to_end(h)
                self._pins[slot] += 1
                out.append(slot)
        for slot in out:
            self._wait_written(slot)
        return out

    def unpin(self, slots: list[int]) -> None:
        with self.lock:
            for slot in slots:
                if self._pins[slot] <= 0:
                    raise ValueError(f"host tier slot {slot} is not pinned")
                self._pins[slot] -= 1

    def drop(self, block_hash: int) -> None:
        """Forget ``block_hash`` (its slot is free again); a pinned slot is kept until unpinned."""
        with self.lock:
            slot = self._slot_of.get(block_hash)
            if slot is None or self._pins[slot]:
                return
            del self._slot_of[block_hash]
            self._pending.pop(slot, None)
            self._free.append(slot)
            if self.events is not None:
                self.events.removed("host", [block_hash])

    def hashes(self) -> list[int]:
        """Every hash held, least recently used first (a snapshot for the router)."""
        with self.lock:
            return [h for h, s in self._slot_of.items() if s not in self._unwritten]

    def leak_report(self) -> str | None:
        pinned = [s for s, n in enumerate(self._pins) if n]
        if pinned:
            return f"host tier: {len(pinned)} slots still pinned (e.g. {pinned[:8]})"
        if len(self._slot_of) + len(self._free) != self.capacity:
            return f"host tier: {len(self._slot_of)} held + {len(self._free)} free != {self.capacity} slots"
        return None
