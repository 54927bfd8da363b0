"""Decode steps launched ahead: the host plans and launches step n+1 while the GPU computes step n.

A synchronous engine leaves the GPU idle between reading step n's sampled tokens and launching step
n+1: scheduling, the attention plan, the graph launch and the output handling all run in that gap
(2.2-2.8 ms of a 15-17 ms batch-64 step of the 8B shape on an H200, docs/gpu.md). With steps launched
ahead, ``LLMEngine.step()`` does, while step n is in flight::

    1. decide whether step n+1 can go ahead (``ahead_batch``): every sequence that is in flight and
       not certain to stop continues, as does every other running decode; nothing waits for admission
       or a prompt chunk; the blocks it needs are free (no preemption)
    2. give each continuing sequence a placeholder token, schedule, and launch step n+1 with those
       rows' input ids copied on the device from step n's sampled ids (model_runner.PrevTokens)
    3. read step n's tokens (waits for step n only), fill the placeholders, decide stops, emit outputs

so the host's work for n+1 (and for n's outputs) runs while the GPU computes n. When step n+1 cannot
go ahead, step n is read alone, and the next ``step()`` schedules as a synchronous engine does.

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
  Prefix-cache blocks are registered when the step is read, never over a placeholder.
* Tensor parallelism: every rank receives rank 0's sampled ids of a launched step (a broadcast on the
  device after the logits gather) and patches the next step's input rows from them as rank 0 does; the
  plan names those rows (engine.tp_plan ``FLAG_TOKENS``, ``fed_dst``/``fed_src``). Off by default under
  TP until it has run on NCCL ranks (``overlap_by_default``).
* Prefill-only requests and steps with a layer sink never go ahead (a prefill worker steps
  synchronously).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model_runner import LaunchedStep, PrevTokens
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence
from engine.tp_group import TPGroup

PLACEHOLDER = -1  # a token a launched step has not returned yet (only ever inside LLMEngine.step)


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not been read."""

    launched: LaunchedStep
    seqs: list[Sequence]  # its sampling rows, in order
    members: set[int] = field(default_factory=set)  # id() of every sequence the step writes KV for
    deferred: list[list[int]] = field(default_factory=list)  # block tables freed once it is read

    def holds(self, seq: Sequence) -> bool:
        return id(seq) in self.members


def goes_ahead(batch: list[ScheduledSeq]) -> bool:
    """A step that may be launched without reading its tokens at once: decode rows only (one token each,
    sampling), none a prefill-only request or carrying a layer sink."""
    return bool(batch) and all(s.num_tokens == 1 and s.samples and not s.seq.prefill_only
                               and s.seq.layer_sink is None for s in batch)


def continues(seq: Sequence, max_model_len: int) -> bool:
    """Whether ``seq``, in the step in flight, may need the step after it: not stopping by length with
    the token in flight (EOS, stop tokens and stop strings are only known once it is read)."""
    after = seq.num_tokens + 1  # with the token in flight
    return after - seq.num_prompt_tokens < seq.params.max_tokens and after < max_model_len


def ahead_batch(scheduler: Scheduler, continuing: list[Sequence]) -> bool:
    """Whether the next step can be scheduled now, with a placeholder appended to each of
    ``continuing`` (in-flight sequences): a pure decode step of every running sequence that has a token
    to compute, whose new blocks are free (no preemption), with no request waiting that could be
    admitted (admission and prompt chunks run in synchronous steps)."""
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        return False
    ahead = {id(s) for s in continuing}
    need = 0
    decodes = 0
    for seq in scheduler.running:
        tokens = seq.num_tokens + (id(seq) in ahead)
        remaining = tokens - seq.num_computed
        if remaining == 0:
            continue
        if remaining > 1 or seq.prefill_only or seq.layer_sink is not None:
            return False
        decodes += 1
        need += max(0, scheduler.blocks_for(tokens) - len(seq.block_table))
    return decodes > 0 and need <= scheduler.bm.num_free_blocks


def prev_tokens(flight: InFlight, batch: list[ScheduledSeq]) -> PrevTokens | None:
    """Which rows of ``batch`` take their input id from ``flight``'s sampled ids on the device."""
    row_of = {id(seq): i for i, seq in enumerate(flight.seqs)}
    dst, src = [], []
    for i, s in enumerate(batch):
        j = row_of.get(id(s.seq))
        if j is not None and s.seq.pending_slot == s.context_len:
            dst.append(i)
            src.append(j)
    if not dst:
        return None
    return PrevTokens(tokens=flight.launched.token_ids, dst=dst, src=src)


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
