"""Continuous batching with chunked prefill under a token budget, bounded by free KV blocks.

Lifecycle of a request (``engine.sequence.Status``)::

    add ─▶ WAITING ──admit (blocks for all its tokens, prefix hit reused)─▶ RUNNING ──finish─▶ FINISHED
              ▲                                                              │ │
              └───────────── preempt (blocks released, recompute later) ─────┘ └─ prefill-only done ─▶ PINNED
    reserve ─▶ RESERVED ── commit (KV written by another worker) ──▶ RUNNING

Every ``schedule()`` builds one step of at most ``max_num_batched_tokens`` tokens:

1. **Decodes first** (running sequences with one token left to compute), oldest first, one token
   each. A decode whose next token starts a new block takes a free block; when none is left the
   *newest* running sequence is preempted (its blocks released; it goes back to the head of the
   queue and is recomputed later, prompt plus what it already generated, with identical results).
2. **Prefill chunks** of running sequences whose prompt is not finished, oldest first, each
   ``min(remaining, budget left)`` tokens. Their blocks were all taken at admission, so a prompt
   never stalls half-way for lack of KV.
3. **Admission**, first come first served, while budget, ``max_num_seqs`` and free blocks allow.
   A request takes the longest cached prefix of full blocks (always leaving >= 1 token to compute
   so it has logits to sample from) plus fresh blocks for the rest of its tokens. When the head of
   the queue does not fit it waits (later requests do not jump it) until running ones finish. If
   nothing holds blocks that could ever come back, it is rejected with a clear error instead of
   waiting forever.

With KV tiers (``engine.kv_tiers``), admission also looks past the GPU prefix hit: the blocks that
follow it in the host or disk tier, as far as loading them beats recomputing, get their bytes copied
into the request's fresh blocks by the load thread. The request is RUNNING but not scheduled while
that load runs (``seq.loading``), so decodes and other prompts go on; once it is done the loaded
blocks count as computed and published, and the prompt continues from the first block that did not
load.

The engine validates requests before they are queued (too long for the context or the whole cache:
``RequestTooLong``; queue at ``max_queue``: ``QueueFull``), so a queued request always fits alone.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass(frozen=True, kw_only=True)
class ScheduledSeq:
    seq: Sequence
    context_len: int  # tokens already in KV before this step
    num_tokens: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the known tokens, so its last position is sampled."""
        return self.context_len + self.num_tokens == self.seq.num_tokens


@dataclass(kw_only=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    rejected: list[Sequence] = field(default_factory=list)  # finished with an error this step
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, watermark: float = 0.01) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}) so every running decode fits in a step")
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks kept free at admission while others run, so admitting one request does not make
        # the next decode step preempt it straight away.
        self.watermark_blocks = math.ceil(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first, preemption takes the tail
        self.held: dict[str, Sequence] = {}  # PINNED and RESERVED sequences (blocks owned by a caller)
        self.num_preemptions = 0
        self.tiers = None  # engine.kv_tiers.KVTiers behind the cache, set by the engine

    # ---- queries ------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def loading(self) -> bool:
        """Some running request waits for its blocks to come back from a tier."""
        return any(seq.loading is not None for seq in self.running)

    # ---- request lifecycle --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence, *, keep_blocks: bool = False) -> list[int]:
        """Take ``seq`` out of whatever stage it is in and release its blocks (idempotent). With
        ``keep_blocks`` the blocks are not released but returned: the caller releases them later (a
        step in flight still writes them, engine.step_ahead)."""
        if seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.held.pop(seq.request_id, None)
        seq.status = Status.FINISHED
        if keep_blocks:
            table, seq.block_table = seq.block_table, []
            return table
        self._free_blocks(seq)
        return []

    def pin(self, seq: Sequence) -> None:
        """A prefill-only request is done: keep its blocks for the caller until ``remove``."""
        self.running.remove(seq)
        seq.status = Status.PINNED
        self.held[seq.request_id] = seq

    def reserve(self, seq: Sequence) -> bool:
        """Decode side: blocks for the whole prompt now, reusing cached full blocks (no compute) and
        loading the tiers' blocks after them while the prefill worker computes the rest (the
        caller counts ``seq.num_computed + seq.tier_planned`` tokens as cached). False (nothing
        taken) when blocks are short."""
        hit = self._prefix_hit(seq, leave_one=False)
        if not self._take_blocks(seq, hit, watermark=0, tier_limit=seq.num_tokens):
            return False
        seq.status = Status.RESERVED
        self.held[seq.request_id] = seq
        return True

    def commit_reserved(self, seq: Sequence) -> None:
        """The reserved prompt's KV is in place: it becomes a running decode. With a tier load still
        running it waits (unscheduled) for the load; a block that failed to load is recomputed here,
        from it to the end of the prompt (the prefill worker did not send it)."""
        self.held.pop(seq.request_id)
        if seq.loading is None:
            seq.num_computed = seq.num_prompt_tokens
            self.register_computed(seq)
        else:
            seq.load_target = seq.num_prompt_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)

    def register_computed(self, seq: Sequence, upto: int | None = None) -> None:
        """Publish newly completed full blocks to the prefix cache: those of the first ``upto`` tokens
        (default ``num_computed``; less while a step launched ahead still writes the last one)."""
        upto = seq.num_computed if upto is None else upto
        full = upto // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_registered:
            return  # the common decode step: no block completed
        hashes = seq.full_block_hashes(self.block_size, upto)
        for i in range(seq.num_registered, full):
            self.bm.register(seq.block_table[i], hashes[i])
        seq.num_registered = full

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted_before = self.num_preemptions
        prefills: list[ScheduledSeq] = []
        self._finish_loads()

        # 1. decodes
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_tokens - seq.num_computed != 1:
                i += 1
                continue
            if not self._grow(seq, seq.num_tokens):
                continue  # seq itself was preempted; running[i] is now the next one
            out.scheduled.append(ScheduledSeq(seq=seq, context_len=seq.num_computed, num_tokens=1))
            budget -= 1
            i += 1
        # 2. chunks of prompts already admitted
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed
            if remaining > 1 and budget > 0 and seq.loading is None:
                n = min(remaining, budget)
                prefills.append(ScheduledSeq(seq=seq, context_len=seq.num_computed, num_tokens=n))
                budget -= n
        # 3. admission
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._prefix_hit(seq, leave_one=True)
            watermark = self.watermark_blocks if self.running else 0
            if not self._take_blocks(seq, hit, watermark=watermark, tier_limit=seq.num_tokens - 1):
                if self.running or self.held:
                    break  # blocks will come back when something finishes or is released
                self.waiting.popleft()
                need = self.blocks_for(seq.num_tokens)
                seq.error = (f"KV cache exhausted: the request needs {need} blocks of {self.block_size} "
                             f"tokens but only {self.bm.num_free_blocks} of {self.bm.num_blocks} are free "
                             f"and nothing running would free more")
                seq.finish_reason = "error"
                seq.status = Status.FINISHED
                out.rejected.append(seq)
                continue
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.first_scheduled_at is None:  # a preempted request keeps its first admission
                seq.first_scheduled_at = time.monotonic()
            self.running.append(seq)
            if seq.loading is not None:
                continue  # scheduled once its blocks are back from the tiers
            n = min(seq.num_tokens - seq.num_computed, budget)
            sched = ScheduledSeq(seq=seq, context_len=seq.num_computed, num_tokens=n)
            (out.scheduled if n == 1 else prefills).append(sched)
            budget -= n
        # Single-token admissions (rare: a 1-token prompt) count as decodes; keep decodes first.
        out.scheduled.extend(prefills)
        out.num_preempted = self.num_preemptions - preempted_before
        return out

    # ---- internals ----------------------------------------------------------------------------
    def _finish_loads(self) -> None:
        """Requests whose tier load is done: the blocks that loaded count as computed and cached."""
        for seq in self.running:
            if seq.loading is not None and seq.loading.done():
                self._settle_load(seq)

    def _settle_load(self, seq: Sequence) -> None:
        loaded, seq.loading = seq.loading.result(), None
        first, n = seq.load_span
        if loaded == n and seq.load_target is not None:
            seq.num_computed = seq.load_target  # a committed reservation: the rest was pushed
        else:
            seq.num_computed = (first + loaded) * self.block_size
        seq.num_tier_tokens = loaded * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed
        self.register_computed(seq)

    def _start_tier_load(self, seq: Sequence, limit: int) -> None:
        """After admission took ``seq``'s GPU prefix hit: load the blocks after it that a tier holds."""
        first = seq.num_computed // self.block_size  # the GPU hit
        hashes = seq.full_block_hashes(self.block_size, limit)[first:limit // self.block_size]
        n = self.tiers.plan(hashes) if hashes else 0
        if n:
            seq.loading = self.tiers.start_load(hashes[:n], seq.block_table[first:first + n])
            seq.load_span, seq.load_target = (first, n), None
            seq.tier_planned = n * self.block_size

    def _prefix_hit(self, seq: Sequence, *, leave_one: bool) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        limit = seq.num_tokens - 1 if leave_one else seq.num_tokens
        return self.bm.match_prefix(seq.full_block_hashes(self.block_size, limit)[:limit // self.block_size])

    def _take_blocks(self, seq: Sequence, hit: list[int], *, watermark: int, tier_limit: int = 0) -> bool:
        """Blocks for all of ``seq``'s tokens: the cached ``hit`` prefix plus fresh ones, the first of
        which get the tiers' blocks for the tokens up to ``tier_limit`` (0: none)."""
        need = self.blocks_for(seq.num_tokens) - len(hit)
        # Hit blocks nobody references sit in the evictable pool, so taking them uses up free blocks.
        revived = sum(1 for b in hit if self.bm.ref_count(b) == 0)
        if need + revived + watermark > self.bm.num_free_blocks:
            return False
        self.bm.acquire(hit)
        seq.block_table = hit + self.bm.allocate(need)
        seq.num_computed = len(hit) * self.block_size
        seq.num_registered = len(hit)
        seq.tier_planned = 0
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed
        if self.tiers is not None and self.enable_prefix_caching and tier_limit:
            self._start_tier_load(seq, tier_limit)
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room in ``seq``'s table for ``num_tokens``, preempting newer sequences if needed.
        False when ``seq`` itself had to be preempted."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        while need > self.bm.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.bm.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        if seq.layer_sink is not None:
            # Its KV is recomputed into other blocks later; whatever a sink was told is void. The
            # recompute runs without a sink (the caller falls back to sending the finished KV).
            seq.layer_sink.abort("preempted")
            seq.layer_sink = None
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free_blocks(self, seq: Sequence) -> None:
        if seq.loading is not None:  # the load thread writes these blocks: let it finish first
            loaded, seq.loading = seq.loading.result(), None
            # what loaded is valid KV: published, it stays in the cache for the next request (a
            # reservation dropped for a local prefill takes it straight back)
            seq.num_computed = max(seq.num_computed, (seq.load_span[0] + loaded) * self.block_size)
            self.register_computed(seq)
        if seq.block_table:
            self.bm.release(seq.block_table)
            seq.block_table = []
