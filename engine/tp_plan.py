"""Rank 0's step plan, sent to the other ranks of a tensor-parallel worker each step.

Only rank 0 runs the scheduler and the sampler; the other ranks own no requests and run exactly
the forward rank 0 runs, on their slice of the model and their heads of the KV cache. Per step
rank 0 broadcasts (over the group's CPU gloo channel, no pickle: two int64 tensors)::

    header  [op, num_seqs, num_tokens, num_table_entries, num_sample_rows, flags]
    payload input_ids[T] | query_lens[S] | context_lens[S] | table_lens[S] | tables[E] | rows[R]

``op`` is ``OP_STEP`` or ``OP_STOP`` (the worker is shutting down; the followers leave their loop).
``rows`` are the flat token rows whose logits are computed (the vocab-parallel ``lm_head`` needs
every rank in that gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import BatchSpec

OP_STOP, OP_STEP = 0, 1
FLAG_GRAPH = 1  # rank 0 replays its decode CUDA graph for this step: the followers replay theirs
_HEADER = 6


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    input_ids: list[int]
    spec: BatchSpec
    rows: list[int]
    flags: int = 0


def send_stop(group) -> None:
    group.broadcast_cpu(torch.tensor([OP_STOP] + [0] * (_HEADER - 1), dtype=torch.int64))


def send_step(group, plan: StepPlan) -> None:
    spec = plan.spec
    flat = [b for table in spec.block_tables for b in table]
    header = [OP_STEP, spec.num_seqs, len(plan.input_ids), len(flat), len(plan.rows), plan.flags]
    group.broadcast_cpu(torch.tensor(header, dtype=torch.int64))
    payload = (plan.input_ids + spec.query_lens + spec.context_lens
               + [len(t) for t in spec.block_tables] + flat + plan.rows)
    group.broadcast_cpu(torch.tensor(payload, dtype=torch.int64))


def receive(group) -> StepPlan | None:
    """The next plan from rank 0, or None when it sent ``OP_STOP``."""
    header = group.broadcast_cpu(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
    op, seqs, tokens, entries, rows, flags = header
    if op == OP_STOP:
        return None
    if op != OP_STEP:
        raise RuntimeError(f"tensor parallel follower: unknown op {op} from rank 0")
    payload = group.broadcast_cpu(torch.zeros(tokens + 3 * seqs + entries + rows, dtype=torch.int64)).tolist()
    ids, payload = payload[:tokens], payload[tokens:]
    qlens, ctx, tlens = payload[:seqs], payload[seqs:2 * seqs], payload[2 * seqs:3 * seqs]
    rest = payload[3 * seqs:]
    tables, pos = [], 0
    for n in tlens:
        tables.append(rest[pos:pos + n])
        pos += n
    return StepPlan(input_ids=ids, spec=BatchSpec(query_lens=qlens, context_lens=ctx, block_tables=tables),
                    rows=rest[pos:pos + rows], flags=flags)
