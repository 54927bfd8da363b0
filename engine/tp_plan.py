"""Rank 0's step plan, sent to the other ranks of a tensor-parallel worker each step.

Only rank 0 runs the scheduler and the sampler; the other ranks own no requests and run exactly
the forward rank 0 runs, on their slice of the model and their heads of the KV cache. Per step
rank 0 broadcasts (over the group's CPU gloo channel, no pickle: two int64 tensors)::

    header  [op, num_seqs, num_tokens, num_table_entries, num_sample_rows, flags, num_fed]
    payload input_ids[T] | query_lens[S] | context_lens[S] | table_lens[S] | tables[E] | rows[R]
            | fed_dst[F] | fed_src[F]

``op`` is ``OP_STEP`` or ``OP_STOP`` (the worker is shutting down; the followers leave their loop).
``rows`` are the flat token rows whose logits are computed (the vocab-parallel ``lm_head`` needs
every rank in that gather).

Decode steps launched ahead (engine.step_ahead): a step whose sampled ids feed the next one has
``FLAG_TOKENS``; after the logits gather every rank joins a broadcast of rank 0's sampled ids on the
device (``TPGroup.broadcast``) and keeps them. The next plan's input ids at rows ``fed_dst`` are
placeholders; each rank writes its kept ids at rows ``fed_src`` there, on the device, as rank 0 does.

The plan is on the critical path of every step: the followers cannot launch their forward before it
arrives, and rank 0's GPU then waits for them in the first all-reduce. So rank 0 builds it with numpy
(a batch of 64 sequences at 4k context carries ~16k block-table entries; Python lists cost ~1.5 ms
there), posts both broadcasts without waiting (``send_step`` returns the pending sends, which rank 0
waits for after launching its own forward), and a follower's block tables stay numpy views of the
received payload (the attention backend converts them to numpy anyway).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.base import BatchSpec

OP_STOP, OP_STEP = 0, 1
FLAG_GRAPH = 1  # rank 0 replays its decode CUDA graph for this step: the followers replay theirs
FLAG_TOKENS = 2  # every rank takes rank 0's sampled ids of this step (the next step's input, step_ahead)
_HEADER = 7


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    input_ids: list[int]
    spec: BatchSpec
    rows: list[int]
    flags: int = 0
    fed_dst: list[int] = field(default_factory=list)  # input rows taken from the last FLAG_TOKENS step's ids
    fed_src: list[int] = field(default_factory=list)  # ... at these rows of them


def send_stop(group) -> None:
    group.broadcast_cpu(torch.tensor([OP_STOP] + [0] * (_HEADER - 1), dtype=torch.int64))


class PendingSend:
    """Rank 0's posted broadcasts of one plan; ``wait()`` before the next plan (gloo keeps their order
    anyway) and at the latest before the step returns. Holds the tensors until then."""

    def __init__(self, works: list, tensors: tuple[torch.Tensor, ...]) -> None:
        self._works, self._tensors = works, tensors

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], ()


def send_step(group, plan: StepPlan) -> PendingSend:
    """Post rank 0's plan to the other ranks; returns the pending sends (see the module docstring)."""
    spec = plan.spec
    tables = spec.block_tables
    lens = [len(t) for t in tables]
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=sum(lens))
    header = torch.tensor([OP_STEP, spec.num_seqs, len(plan.input_ids), len(flat), len(plan.rows),
                           plan.flags, len(plan.fed_dst)], dtype=torch.int64)
    head = np.array(plan.input_ids + list(spec.query_lens) + list(spec.context_lens) + lens, dtype=np.int64)
    tail = np.asarray(list(plan.rows) + list(plan.fed_dst) + list(plan.fed_src), dtype=np.int64)
    payload = torch.from_numpy(np.concatenate([head, flat, tail]))
    works = [group.broadcast_cpu_async(header), group.broadcast_cpu_async(payload)]
    return PendingSend(works, (header, payload))


def receive(group) -> StepPlan | None:
    """The next plan from rank 0, or None when it sent ``OP_STOP``. Block tables are numpy views."""
    header = group.broadcast_cpu(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
    op, seqs, tokens, entries, rows, flags, fed = header
    if op == OP_STOP:
        return None
    if op != OP_STEP:
        raise RuntimeError(f"tensor parallel follower: unknown op {op} from rank 0")
    size = tokens + 3 * seqs + entries + rows + 2 * fed
    payload = group.broadcast_cpu(torch.zeros(size, dtype=torch.int64)).numpy()
    ids = payload[:tokens].tolist()
    small = payload[tokens:tokens + 3 * seqs]
    qlens, ctx, tlens = small[:seqs].tolist(), small[seqs:2 * seqs].tolist(), small[2 * seqs:]
    flat = payload[tokens + 3 * seqs:tokens + 3 * seqs + entries]
    tables = np.split(flat, np.cumsum(tlens)[:-1]) if seqs else []
    tail = payload[tokens + 3 * seqs + entries:].tolist()
    return StepPlan(input_ids=ids, spec=BatchSpec(query_lens=qlens, context_lens=ctx, block_tables=tables),
                    rows=tail[:rows], flags=flags, fed_dst=tail[rows:rows + fed], fed_src=tail[rows + fed:])
