"""Pair scoring with bounded load: the ``prefix`` policy's decision, as pure functions.

Estimated seconds until the request's first token, for a (prefill p, decode d) pair:

    cost(p, d) = uncached_tokens(p) / prefill_tokens_per_s          # prefill compute left
               + queue_cost_s * load(p)                              # waiting behind p's queue
               + queue_cost_s * load(d) + kv_pressure_cost_s * used(d)^2
               + missing_blocks(d) * bytes_per_block / bandwidth(p, d)   # KV transfer

``uncached_tokens(p)`` = prompt tokens beyond the prefix p is believed to hold; ``missing_blocks(d)``
= full blocks d is believed to lack; ``used(d)`` = fraction of d's KV blocks in use.

Bounded load (consistent hashing with bounded loads): in each pool a worker is eligible only if
``load + 1 <= ceil((1 + epsilon) * (total_load + 1) / n)``; the least-loaded worker always
qualifies, so the bound can only be lifted when the whole pool is saturated alike. Decode workers
without room for the blocks they would receive are skipped while another has room.

The search is pruned: the best ``top_k`` prefill workers by their own cost and the best
``top_k`` decode workers by their own cost plus transfer at the default bandwidth are paired, so
a decision stays O(P + D + k^2) rather than O(P x D). Ties break by a per-request rotation of
worker ids (hash of the first block), so equal workers share identical prefixes deterministically
on every router replica.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

# A candidate is a plain tuple on the hot path (dataclass construction costs more than the scoring):
# (worker_id, load, cached_blocks, free_blocks or -1 if unknown, total_blocks or 0 if unknown)
Candidate = tuple[str, int, int, int, int]


@dataclass(frozen=True)
class PairChoice:
    prefill_id: str
    decode_id: str
    cost: float
    prefill_cached: int
    decode_cached: int
    bounded: bool  # True if the load bound had to be lifted (every worker was at the bound)


_TIE_CACHE: dict[str, int] = {}


def _worker_hash(worker_id: str) -> int:
    h = _TIE_CACHE.get(worker_id)
    if h is None:
        h = zlib.crc32(worker_id.encode())
        if len(_TIE_CACHE) < 100_000:
            _TIE_CACHE[worker_id] = h
    return h


def tie_key(worker_id: str, salt: int) -> int:
    return ((_worker_hash(worker_id) ^ salt) * 0x9E3779B1) & 0xFFFFFFFF  # the salt permutes the order


def load_cap(loads: Sequence[int], epsilon: float) -> int:
    """Largest load a worker may reach by taking one more request (bounded-loads bound)."""
    n = len(loads)
    return max(1, math.ceil((1.0 + epsilon) * (sum(loads) + 1) / n))


def eligible(cands: list[Candidate], epsilon: float) -> tuple[list[Candidate], bool]:
    cap = load_cap([c[1] for c in cands], epsilon)
    ok = [c for c in cands if c[1] + 1 <= cap]
    if ok:
        return ok, False
    return cands, True


def choose_pair(
    prefill: list[Candidate],
    decode: list[Candidate],
    *,
    n_blocks: int,
    prompt_len: int,
    block_size: int,
    epsilon: float,
    prefill_tokens_per_s: float,
    queue_cost_s: float,
    kv_pressure_cost_s: float,
    bytes_per_block: float,
    default_bw: float,
    bandwidth_rows: dict[str, dict[str, float]],
    top_k: int,
    salt: int,
) -> PairChoice:
    """Best pair; ``bandwidth_rows[prefill_id][decode_id]`` = measured link bandwidth (else default)."""
    ps, p_lifted = eligible(prefill, epsilon)
    ds, d_lifted = eligible(decode, epsilon)
    roomy = [c for c in ds if c[3] < 0 or c[3] >= n_blocks - c[2]]
    if roomy:
        ds = roomy
    ties = _TIE_CACHE
    mix = 0x9E3779B1

    pk = []
    for c in ps:
        uncached = prompt_len - c[2] * block_size
        h = ties.get(c[0])
        if h is None:
            h = _worker_hash(c[0])
        pk.append(((uncached if uncached > 0 else 0) / prefill_tokens_per_s + queue_cost_s * c[1],
                   ((h ^ salt) * mix) & 0xFFFFFFFF, c))
    dk = []
    for c in ds:
        used = 1.0 - c[3] / c[4] if c[4] > 0 and c[3] >= 0 else 0.0
        own = queue_cost_s * c[1] + kv_pressure_cost_s * used * used
        miss = n_blocks - c[2]
        miss_bytes = miss * bytes_per_block if miss > 0 else 0.0
        h = ties.get(c[0])
        if h is None:
            h = _worker_hash(c[0])
        dk.append((own + miss_bytes / default_bw, ((h ^ salt) * mix) & 0xFFFFFFFF, c, own, miss_bytes))
    if not any(p[2][0] in bandwidth_rows for p in pk):
        # No measured link from any candidate: the cost separates, each pool's best is the answer.
        pc, _, p = min(pk)
        dc, _, d, _, _ = min(dk)
        return PairChoice(prefill_id=p[0], decode_id=d[0], cost=pc + dc, prefill_cached=p[2],
                          decode_cached=d[2], bounded=p_lifted or d_lifted)
    if len(pk) > top_k:
        pk = heapq.nsmallest(top_k, pk)
    if len(dk) > top_k:
        dk = heapq.nsmallest(top_k, dk)
    best = None
    best_key = None
    for pc, pt, p in pk:
        row = bandwidth_rows.get(p[0], _EMPTY)
        for _, dt, d, own, miss_bytes in dk:
            total = pc + own + (miss_bytes / row.get(d[0], default_bw) if miss_bytes else 0.0)
            key = (total, pt, dt)
            if best_key is None or key < best_key:
                best_key, best = key, (p, d)
    assert best is not None and best_key is not None  # callers never pass empty pools
    p, d = best
    return PairChoice(prefill_id=p[0], decode_id=d[0], cost=best_key[0], prefill_cached=p[2],
                      decode_cached=d[2], bounded=p_lifted or d_lifted)


_EMPTY: dict[str, float] = {}


def overloaded(load: int, loads: Sequence[int], epsilon: float, min_load: int = 0) -> bool:
    """Whether a worker at ``load`` would exceed the (1 + epsilon) bound by taking one more request
    (never below ``min_load``, where small absolute numbers make ratios meaningless)."""
    return len(loads) > 1 and load >= min_load and load + 1 > load_cap(loads, epsilon)
