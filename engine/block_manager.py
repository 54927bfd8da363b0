"""Paged KV block allocator: reference counts, chained prefix hashes, LRU reuse of cached blocks.

Lifecycle of a block id::

    free (no hash) ──allocate──▶ in use (ref ≥ 1) ──release, ref→0──▶ free (no hash)
                                     │  ▲
                             register│  │hit (ref 0→1)
                                     ▼  │
                          in use + hashed ──release, ref→0──▶ cached (hash kept, evictable, LRU)
                                                                   │
                                            allocate, nothing else free: evict ──▶ in use (no hash)

* A block is *hashed* once it is full and its KV is computed; its hash is the chained prefix hash
  of ``engine.prefix_hash``, so a hit on block ``i`` implies the whole prefix up to ``i`` matches.
* A hashed block whose reference count drops to zero is not wiped: it waits in an LRU list and a
  later request with the same prefix takes it back (``ref 0 → 1``) instead of recomputing it.
  Fresh allocations prefer never-hashed blocks and only then evict the least recently used
  cached one.
* "Free" for admission purposes means ``ref == 0``: plain free blocks plus evictable cached ones.
* An allocation comes out in **ascending runs of consecutive ids**: from each block the policy
  picks (the next plain free block, else the least recently used cached one) it takes the free ids
  around it too, the ones just below it first (cached ones only once no plain free block is left),
  then picks again.
  A request's KV moves between workers as (layer, run) pieces -- one descriptor per run over NIXL,
  one copy per run (or a gather past a few) over TCP -- so runs, not blocks, are what a transfer
  costs. Handing out blocks one by one in LRU order made a warm cache's allocations one run per
  block: ``release`` queues a table's tail first, so eviction returned each freed run reversed.
  A cached neighbour joins a run only if it was released not long after the block the run started
  from (``RUN_REACH``): about the blocks LRU would evict for it anyway (a table's blocks are released
  together), not a hot prefix that sits next to an old block; unbounded, runs were longer and the
  prefix cache's hit ratio fell by a tenth in a simulation.

Tiers (``engine.kv_tiers``): an allocation that evicts cached blocks hands them, ``(block id, hash)``
in one batch, to ``on_evict`` before returning them, so their bytes are copied to the host tier before
their new owner overwrites them.

The manager knows nothing about sequences; ``engine.scheduler`` owns the per-request block tables.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from engine.errors import KVCacheFull

# How far past LRU order a run may evict: a cached neighbour joins an allocation of n blocks only if it
# was released within RUN_REACH * n releases of the run's first block. A churn simulation with shared
# prefixes (60 prefixes of 8-64 blocks, Zipf popularity, 2,000 blocks, 6,000 requests; a shorter one is
# tests/unit/test_block_manager.py::test_runs_cost_the_prefix_cache_almost_nothing) gave, by reach:
# 1: hit ratio 0.332, 0.43 runs per allocated block; 4: 0.330, 0.13; 8: 0.326, 0.07; unbounded: 0.298,
# 0.02; one by one in LRU order: 0.333, 0.90.
RUN_REACH = 4


class BlockManager:
    """Owns the reference counts and the prefix-hash index of ``num_blocks`` KV blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}  # prefix hash -> block id
        # Plain free blocks as an insertion-ordered set (O(1) removal of a run's neighbours); popping
        # from the end hands out low ids first on a fresh cache.
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref-0 hashed blocks, LRU first
        # When each block last went to ref 0, counted in blocks released: a run grows into a cached
        # neighbour only if it was released about as long ago as the block the run started from.
        self._released = [0] * num_blocks
        self._releases = 0
        self.hits = 0  # blocks served from the prefix cache, for metrics
        self.evictions = 0
        # Called once per allocation with the cached blocks it evicted, before they are handed out.
        self.on_evict: Callable[[list[tuple[int, int]]], None] | None = None
        self._evicted: list[tuple[int, int]] = []
        self.events = None  # engine.kv_events.KVEvents: hashes gained and lost ("device" tier)

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take right now (never-hashed free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of[block_id]

    def hashes(self) -> list[int]:
        """Every prefix hash a block holds now (in use or cached), oldest registration first."""
        return list(self._block_of)

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest run of leading ``hashes`` that are cached (does not take them)."""
        out: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            out.append(block)
        return out

    # ---- mutations ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with ref 1 and no hash; raises ``KVCacheFull`` (taking none) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise KVCacheFull(f"need {n} KV blocks, only {self.num_free_blocks} of {self.num_blocks} free")
        out: list[int] = []
        while len(out) < n:
            if self._free:
                seed, _ = self._free.popitem()
            else:
                seed, _ = self._evictable.popitem(last=False)
                self._forget_hash(seed)
            self._ref[seed] = 1
            # The run around it: free ids just below it (the start of the range it was freed with),
            # then it, then free ids above, up to what is still wanted. Cached neighbours qualify only
            # if released within RUN_REACH x n releases after the seed (see RUN_REACH).
            oldest = self._released[seed] + RUN_REACH * n
            want = n - len(out) - 1
            below: list[int] = []
            while len(below) < want and self._take_if_free(seed - len(below) - 1, oldest):
                below.append(seed - len(below) - 1)
            out.extend(reversed(below))
            out.append(seed)
            nxt = seed + 1
            while len(out) < n and self._take_if_free(nxt, oldest):
                out.append(nxt)
                nxt += 1
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            if self.events is not None:
                self.events.removed("device", [h for _, h in evicted])
            if self.on_evict is not None:
                self.on_evict(evicted)
        return out

    def _take_if_free(self, block: int, oldest: int) -> bool:
        """Take ``block`` (ref 1, no hash) if it is plain free, or cached, released no later than
        ``oldest``, with no plain free block left."""
        if not 0 <= block < self.num_blocks or self._ref[block] != 0:
            return False
        if block in self._free:
            del self._free[block]
        elif not self._free and block in self._evictable and self._released[block] <= oldest:
            del self._evictable[block]
            self._forget_hash(block)
        else:
            return False
        self._ref[block] = 1
        return True

    def _forget_hash(self, block: int) -> None:
        """An evicted cached block: its prefix hash no longer names it."""
        self._evicted.append((block, self._hash_of[block]))
        del self._block_of[self._hash_of[block]]
        self._hash_of[block] = None
        self.evictions += 1

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit, or a second owner of a block)."""
        for block in blocks:
            if self._ref[block] == 0:
                if block not in self._evictable:
                    raise ValueError(f"block {block} is free and not cached; it cannot be shared")
                del self._evictable[block]
                self.hits += 1
            self._ref[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. Pass a block table in order: its *tail* blocks end up
        evicted first, so the most shareable leading blocks of a prefix stay cached longest."""
        for block in reversed(blocks):
            ref = self._ref[block]
            if ref <= 0:
                raise ValueError(f"double free of KV block {block}")
            self._ref[block] = ref - 1
            if ref == 1:
                self._releases += 1
                self._released[block] = self._releases
                if self._hash_of[block] is None:
                    self._free[block] = None
                else:
                    self._evictable[block] = None

    def register(self, block_id: int, block_hash: int) -> bool:
        """Publish a full, computed, in-use block under its prefix hash.

        Returns False (and leaves the block unhashed) when another block already holds that hash,
        e.g. two identical prompts prefilled at the same time; the first one stays canonical.
        """
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use; only in-use blocks can be registered")
        current = self._hash_of[block_id]
        if current is not None:
            return current == block_hash
        if block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        if self.events is not None:
            self.events.stored("device", [block_hash])
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (e.g. after weights change); returns how many."""
        n = len(self._evictable)
        if self.events is not None:
            self.events.removed("device", [self._hash_of[b] for b in self._evictable])
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of[block]]
            self._hash_of[block] = None
            self._free[block] = None
        return n

    # ---- checks -------------------------------------------------------------------------------
    def leak_report(self) -> str | None:
        """None when every block is free or evictable-cached with ref 0; otherwise what leaked."""
        held = [b for b, r in enumerate(self._ref) if r != 0]
        if held or self.num_free_blocks != self.num_blocks:
            return (f"{len(held)} KV blocks still referenced (e.g. {held[:8]}); "
                    f"{self.num_free_blocks}/{self.num_blocks} free")
        return None
