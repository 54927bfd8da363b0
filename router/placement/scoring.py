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
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    load: int
    cached_blocks: int
    free_blocks: int  # -1 = unknown
    total_blocks: int  # 0 = unknown


@dataclass(frozen=True)
class PairChoice:
    prefill_id: str
    decode_id: str
    cost: float
    prefill_cached: int
    decode_cached: int
    bounded: bool  # True if the load bound had to be lifted (every worker was at the bound)


_TIE_CACHE: dict[str, int] = {}


def tie_key(worker_id: str, salt: int) -> int:
    h = _TIE_CACHE.get(worker_id)
    if h is None:
        h = zlib.crc32(worker_id.encode())
        if len(_TIE_CACHE) < 100_000:
            _TIE_CACHE[worker_id] = h
    return ((h ^ salt) * 0x9E3779B1) & 0xFFFFFFFF  # multiplicative mix: salt permutes the order


def load_cap(loads: Sequence[int], epsilon: float) -> int:
    """Largest load a worker may reach by taking one more request (bounded-loads bound)."""
    n = len(loads)
    return max(1, math.ceil((1.0 + epsilon) * (sum(loads) + 1) / n))


def eligible(cands: list[Candidate], epsilon: float) -> tuple[list[Candidate], bool]:
    cap = load_cap([c.load for c in cands], epsilon)
    ok = [c for c in cands if c.load + 1 <= cap]
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
    bandwidth: Callable[[str, str], float],
    top_k: int,
    salt: int,
) -> PairChoice:
    ps, p_lifted = eligible(prefill, epsilon)
    ds, d_lifted = eligible(decode, epsilon)
    roomy = [c for c in ds if c.free_blocks < 0 or c.free_blocks >= n_blocks - c.cached_blocks]
    if roomy:
        ds = roomy

    def p_cost(c: Candidate) -> float:
        uncached = max(0, prompt_len - c.cached_blocks * block_size)
        return uncached / prefill_tokens_per_s + queue_cost_s * c.load

    def d_cost(c: Candidate) -> float:
        used = 0.0
        if c.total_blocks > 0 and c.free_blocks >= 0:
            used = 1.0 - c.free_blocks / c.total_blocks
        return queue_cost_s * c.load + kv_pressure_cost_s * used * used

    pk = [(p_cost(c), tie_key(c.worker_id, salt), c) for c in ps]
    dk = []
    for c in ds:
        miss_bytes = max(0, n_blocks - c.cached_blocks) * bytes_per_block
        dk.append((d_cost(c) + miss_bytes / default_bw, tie_key(c.worker_id, salt), c, miss_bytes))
    if len(pk) > top_k:
        pk = heapq.nsmallest(top_k, pk, key=lambda t: (t[0], t[1]))
    if len(dk) > top_k:
        dk = heapq.nsmallest(top_k, dk, key=lambda t: (t[0], t[1]))

    best: tuple | None = None
    for pc, pt, p in pk:
        for dcost_default, dt, d, miss_bytes in dk:
            dc = dcost_default - miss_bytes / default_bw
            bw = bandwidth(p.worker_id, d.worker_id)
            total = pc + dc + (miss_bytes / bw if miss_bytes else 0.0)
            key = (total, pt, dt)
            if best is None or key < best[0]:
                best = (key, p, d)
    assert best is not None  # callers never pass empty pools
    (total, _, _), p, d = best
    return PairChoice(prefill_id=p.worker_id, decode_id=d.worker_id, cost=total,
                      prefill_cached=p.cached_blocks, decode_cached=d.cached_blocks,
                      bounded=p_lifted or d_lifted)


def overloaded(load: int, loads: Sequence[int], epsilon: float, min_load: int = 0) -> bool:
    """Whether a worker at ``load`` would exceed the (1 + epsilon) bound by taking one more request
    (never below ``min_load``, where small absolute numbers make ratios meaningless)."""
    return len(loads) > 1 and load >= min_load and load + 1 > load_cap(loads, epsilon)
