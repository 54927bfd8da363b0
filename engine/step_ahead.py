"""Decode steps launched ahead: the host plans and launches step n+1 while the GPU computes step n.

A synchronous engine leaves the GPU idle between reading step n's sampled tokens and launching step
n+1: scheduling, the attention plan, the graph launch and the output handling all run in that gap
(2.2-2.8 ms of a 15-17 ms batch-64 step of the 8B shape on an H200, docs/gpu.md). With steps launched
ahead, ``LLMEngine.step()`` does, while step n is in flight::

    1. decide whether step n+1 can go ahead (``ahead_batch``): every sequence that sampled in step n
       and is not certain to stop continues; the decodes' new blocks are free, so nothing is
       preempted (prompt chunks and admissions go ahead too: they never preempt)
    2. give each continuing sequence a placeholder token, schedule, and launch step n+1 with those
       rows' input ids copied on the device from step n's sampled ids (model_runner.PrevTokens)
    3. read step n's tokens (waits for step n only), fill the placeholders, decide stops, emit outputs

so the host's work for n+1 (and for n's outputs) runs while the GPU computes n. When step n+1 cannot
go ahead (it would preempt), step n is read alone, and the next ``step()`` schedules as a synchronous
engine does.

What it costs, and the rules that keep it exact:

* A sequence that stops at step n (EOS, a stop token or string) has computed one more token in step
  n+1; that token is dropped. A stop by length is known before the launch: such a sequence does not
  continue. Its output is exactly a synchronous engine's (same tokens, same seeded draws: its
  generator draws for the dropped token after its last real one).
* No block a step in flight writes is freed before that step completes: a sequence that finishes or
  is aborted while it is a member of the step in flight keeps its blocks until the step is read
  (``InFlight.deferred``). KV transfers write other blocks on other streams, so a block freed early
  could be handed to a transfer while the step still writes it.
* Placeholders exist only inside ``step()``: between calls every token of every sequence is real.
  Prefix-cache blocks are registered when the step is read, never over a placeholder, and never over KV
  the next step in flight is still writing.
* Tensor parallelism: every rank receives rank 0's sampled ids of a launched step (a broadcast on the
  device after the logits gather) and patches the next step's input rows from them as rank 0 does; the
  plan names those rows (engine.tp_plan ``FLAG_TOKENS``, ``fed_dst``/``fed_src``). Off by default under
  TP until it has run on NCCL ranks (``overlap_by_default``).
* Prefill-only requests and steps with a layer sink never go ahead (a prefill worker steps
  synchronously).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.engine_types import StepOutput
from engine.model_runner import LaunchedStep, PrevTokens
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, Status
from engine.tp_group import TPGroup

PLACEHOLDER = -1  # a token a launched step has not returned yet (only ever inside LLMEngine.step)


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not been read."""

    launched: LaunchedStep
    seqs: list[Sequence]  # its sampling rows, in order
    computing: dict[int, int] = field(default_factory=dict)  # id() of each sequence -> tokens it computes
    chunks: list[Sequence] = field(default_factory=list)  # its rows that sample nothing (prompt chunks)
    deferred: list[list[int]] = field(default_factory=list)  # block tables freed once it is read
    prompt_tokens: int = 0  # of its tokens, prompt tokens (the KV tiers' cost model times them)
    num_tokens: int = 0  # tokens it computes (the step histograms)
    launched_at: float = 0.0  # time.perf_counter() before its launch

    def holds(self, seq: Sequence) -> bool:
        return id(seq) in self.computing


def goes_ahead(batch: list[ScheduledSeq]) -> bool:
    """A step that may be launched without reading its tokens at once: none of its rows a prefill-only
    request or carrying a layer sink (a prefill worker steps synchronously)."""
    return bool(batch) and all(not s.seq.prefill_only and s.seq.layer_sink is None for s in batch)


def continues(seq: Sequence, max_model_len: int) -> bool:
    """Whether ``seq``, sampling in the step in flight, may need the step after it: not stopping by length
    with the token in flight (EOS, stop tokens and stop strings are only known once it is read)."""
    after = seq.num_tokens + 1  # with the token in flight
    return after - seq.num_prompt_tokens < seq.params.max_tokens and after < max_model_len


def ahead_batch(scheduler: Scheduler, continuing: list[Sequence], throttles=None) -> bool:
    """Whether the next step can be scheduled now, with a placeholder appended to each of ``continuing``
    (in-flight sequences that sampled): there is work (a token to compute, or a request waiting), no
    running or waiting request is prefill-only, and the decodes' new blocks are free, so scheduling
    preempts nothing (prompt chunks hold their blocks since admission, and admission takes only free
    blocks).

    ``throttles(n)``: whether the runner launches a step of ``n`` tokens throttled to the GPU's pace
    (``ModelRunner.throttles``). Such a launch returns only near the end of that step, so launching it
    before reading the step in flight would hold that step's tokens back by the whole of it (a first
    token, or every decode's token, a prompt chunk's step late). When the next step may be that large
    -- every prompt token left to compute and every waiting prompt counted, up to the step budget --
    it is not launched ahead."""
    if any(seq.prefill_only for seq in scheduler.waiting):
        return False  # admitting it would make a step that cannot go ahead
    ahead = {id(s) for s in continuing}
    need = 0
    tokens_next = sum(seq.num_tokens for seq in scheduler.waiting) if throttles is not None else 0
    work = bool(scheduler.waiting)
    for seq in scheduler.running:
        if seq.prefill_only or seq.layer_sink is not None:
            return False
        tokens = seq.num_tokens + (id(seq) in ahead)
        remaining = tokens - seq.num_computed
        work = work or remaining > 0
        tokens_next += remaining
        if remaining == 1:
            need += max(0, scheduler.blocks_for(tokens) - len(seq.block_table))
    if throttles is not None and throttles(min(tokens_next, scheduler.max_num_batched_tokens)):
        return False
    return work and need <= scheduler.bm.num_free_blocks


def prev_tokens(flight: InFlight, batch: list[ScheduledSeq]) -> PrevTokens | None:
    """Which input ids of ``batch`` (flat token positions) are ``flight``'s sampled ids, still on the
    device: the placeholder of each sequence that sampled in ``flight``."""
    row_of = {id(seq): i for i, seq in enumerate(flight.seqs)}
    dst, src = [], []
    offset = 0
    for s in batch:
        j = row_of.get(id(s.seq))
        if j is not None and s.seq.pending_slot == s.context_len:
            dst.append(offset)
            src.append(j)
        offset += s.num_tokens
    if not dst:
        return None
    return PrevTokens(tokens=flight.launched.token_ids, dst=dst, src=src)


class LaunchAhead:
    """``LLMEngine``'s half that launches steps ahead: the step in flight (``_inflight``), its launch, the
    launch of the step after it, and its read. Uses the engine's scheduler, runner and output handling."""

    _inflight: InFlight | None

    def sync(self) -> list[StepOutput]:
        """Wait for a step launched ahead and take its tokens (outputs of requests still held); a no-op
        without one. ``engine.async_engine`` calls it on shutdown so every deferred block comes back."""
        if self._inflight is None:
            return []
        flight, self._inflight = self._inflight, None
        return self._read(flight)

    def _launch(self, batch: list[ScheduledSeq], prev: InFlight | None) -> InFlight:
        """Launch a step without reading its tokens; KV counts as computed, prefix-cache blocks are
        registered when it is read (its input tokens may still be placeholders)."""
        prompt_tokens = self._count(batch)
        launched_at = time.perf_counter()
        launched = self.runner.launch(batch, prev_tokens(prev, batch) if prev is not None else None,
                                      feeds_next=True)
        for s in batch:
            s.seq.num_computed += s.num_tokens
        return InFlight(launched=launched, seqs=[s.seq for s in batch if s.samples],
                        computing={id(s.seq): s.num_tokens for s in batch},
                        chunks=[s.seq for s in batch if not s.samples], prompt_tokens=prompt_tokens,
                        launched_at=launched_at, num_tokens=sum(s.num_tokens for s in batch))

    def _launch_ahead(self, flight: InFlight) -> InFlight | None:
        """Schedule and launch the step after ``flight`` before reading it, or None when it cannot go
        ahead (engine.step_ahead.ahead_batch): ``flight`` is then read alone."""
        live = [seq for seq in flight.seqs if seq.status is Status.RUNNING]
        continuing = [seq for seq in live if continues(seq, self.max_model_len)]
        if not ahead_batch(self.scheduler, continuing, self.runner.throttles):
            return None
        for seq in continuing:
            seq.pending_slot = seq.num_tokens
            seq.tokens.append(PLACEHOLDER)
        sched = self.scheduler.schedule()
        self._pending += self._rejected(sched)
        if not sched.scheduled and not continuing:
            return None  # only a queued request, and it did not fit: nothing to launch
        if sched.num_preempted or not goes_ahead(sched.scheduled):  # ahead_batch rules both out
            raise RuntimeError(f"a step scheduled ahead preempted or cannot go ahead: {sched}")
        self.stats.steps_ahead += 1
        return self._launch(sched.scheduled, flight)

    def _read(self, flight: InFlight) -> list[StepOutput]:
        """Wait for ``flight``'s tokens and take them; then free what finished while it was in flight."""
        tokens, logprobs = flight.launched.result()
        took = time.perf_counter() - flight.launched_at  # launch to tokens: an upper bound of its time
        self.step_histograms.observe(took, len(flight.computing), flight.num_tokens)
        if self.tiers is not None and flight.prompt_tokens:
            self.tiers.cost.record_prefill(flight.prompt_tokens, took)
        live = [(seq, t, lp) for seq, t, lp in zip(flight.seqs, tokens, logprobs, strict=True)
                if seq.status is Status.RUNNING]  # aborted meanwhile: already answered
        outputs = self._take_tokens([x[0] for x in live], [x[1] for x in live], [x[2] for x in live],
                                    register=True)
        for seq in flight.chunks:
            if seq.status is Status.RUNNING:
                self._register(seq)
        for table in flight.deferred:
            self.block_manager.release(table)
        return outputs

    def _register(self, seq: Sequence) -> None:
        """Publish ``seq``'s completed full blocks, short of the KV the step in flight still writes."""
        writing = self._inflight.computing.get(id(seq), 0) if self._inflight is not None else 0
        self.scheduler.register_computed(seq, seq.num_computed - writing)


def overlap_by_default(configured: bool | None, device: torch.device, tp: TPGroup | None) -> bool:
    """Whether an engine launches decode steps ahead: ``EngineConfig.overlap_steps``, else
    ``PDSERVE_OVERLAP_STEPS``, else on CUDA at tensor parallel size 1 (on CPU a launch computes the step,
    so nothing overlaps; under TP it is on only when asked for: it has run on CPU ranks, not yet on NCCL
    ones)."""
    from pdserve.settings import overlap_steps

    want = configured if configured is not None else overlap_steps()
    if want is None:
        want = device.type == "cuda" and tp is None
    return want
