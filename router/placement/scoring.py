"""Pair scoring with bounded load: the prefix policies' decision, as pure functions.

Estimated seconds until the request's first token for a (prefill p, decode d) pair, every term from
the router's one cost model (``router/costs.py``), which the Placer turns into two per-candidate
costs and one per-pair term:

    cost(p, d) = prefill_cost(p)          what p has queued from this router + computing what p
                                          does not cache, at p's learned rate
               + decode_cost(d)           0, or (no prefill pool) d's queued local prefills + d's own
                                          prefill of what *d* does not cache
               + transfer(p, d, missing(d))   the KV blocks d lacks over the measured (p, d) link

A decode worker's cached blocks count: they are not shipped again, and (no prefill pool) not
recomputed; so at equal load the pair holding a warm prefix costs strictly less and wins. Load is
not priced in seconds (a load report is up to a poll interval old, and a worker's request count
says little about this request's first token): it bounds who may be chosen (below) and breaks
exact ties (less loaded, then more free KV, then the tie key), so a stale report cannot throw a
warm prefix away.

Bounded load (consistent hashing with bounded loads): in each pool a worker is eligible only if
``load + 1 <= ceil((1 + epsilon) * (total_load + 1) / n)``; the least-loaded worker always
qualifies, so the bound can only be lifted when the whole pool is saturated alike. Decode workers
without room for the blocks they would receive are skipped while another has room.

The search is pruned: the best ``top_k`` prefill workers by their own cost and the best ``top_k``
decode workers by their own cost plus transfer at the default bandwidth are paired, so a decision
stays O(P + D + k^2) rather than O(P x D). Only exactly equal costs fall to the tie key, a
per-request rotation of worker ids (hash of the first block), so equal workers share identical
prefixes deterministically on every router replica.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Sequence
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


def _used(c: Candidate) -> float:
    return 1.0 - c[3] / c[4] if c[4] > 0 and c[3] >= 0 else 0.0


def choose_pair(
    prefill: list[Candidate] | None,
    decode: list[Candidate],
    *,
    n_blocks: int,
    epsilon: float,
    prefill_cost: Callable[[Candidate], float],
    decode_cost: Callable[[Candidate], float],
    transfer_s: Callable[[str, str, int], float],
    measured_from: Callable[[str], bool],
    top_k: int,
    salt: int,
) -> PairChoice:
    """Best pair (``prefill`` None: no prefill pool, the best decode worker alone).

    ``transfer_s(prefill_id, decode_id, missing_blocks)``: seconds to ship them over that link
    (``prefill_id=""``: the default link); ``measured_from(prefill_id)``: whether any link from that
    worker was measured (if none was, the cost separates and each pool's best is the answer).
    Equal costs go to the less loaded pair, then the one with more free KV, then the tie key."""
    ds, d_lifted = eligible(decode, epsilon)
    roomy = [c for c in ds if c[3] < 0 or c[3] >= n_blocks - c[2]]
    if roomy:
        ds = roomy
    mix = 0x9E3779B1
    dk = []
    for c in ds:
        own = decode_cost(c)
        miss = n_blocks - c[2] if prefill is not None else 0
        tie = ((_worker_hash(c[0]) ^ salt) * mix) & 0xFFFFFFFF
        cost = own + (transfer_s("", c[0], miss) if miss > 0 else 0.0)
        dk.append((cost, c[1], _used(c), tie, c, own, miss))
    if prefill is None:
        d = min(dk)
        return PairChoice(prefill_id="", decode_id=d[4][0], cost=d[0], prefill_cached=0,
                          decode_cached=d[4][2], bounded=d_lifted)
    ps, p_lifted = eligible(prefill, epsilon)
    pk = [(prefill_cost(c), c[1], _used(c), ((_worker_hash(c[0]) ^ salt) * mix) & 0xFFFFFFFF, c) for c in ps]
    if not any(measured_from(p[4][0]) for p in pk):
        p, d = min(pk), min(dk)
        return PairChoice(prefill_id=p[4][0], decode_id=d[4][0], cost=p[0] + d[0], prefill_cached=p[4][2],
                          decode_cached=d[4][2], bounded=p_lifted or d_lifted)
    if len(pk) > top_k:
        pk = heapq.nsmallest(top_k, pk)
    if len(dk) > top_k:
        dk = heapq.nsmallest(top_k, dk)
    best = None
    best_key = None
    for pc, pl, pu, pt, p in pk:
        for _, dl, du, dt, d, own, miss in dk:
            total = pc + own + (transfer_s(p[0], d[0], miss) if miss > 0 else 0.0)
            key = (total, pl + dl, pu + du, pt, dt)
            if best_key is None or key < best_key:
                best_key, best = key, (p, d)
    assert best is not None and best_key is not None  # callers never pass empty pools
    p, d = best
    return PairChoice(prefill_id=p[0], decode_id=d[0], cost=best_key[0], prefill_cached=p[2],
                      decode_cached=d[2], bounded=p_lifted or d_lifted)


def session_bound(others: Sequence[int], epsilon: float) -> float:
    """Most requests a session's bound worker may hold before its session moves: (1 + epsilon) x
    (the other workers' average + 1). Against the *others*, so that with two workers a bound one
    can exceed it (a bound over all workers' average never trips when the other worker is idle)."""
    if not others:
        return math.inf
    return (1.0 + epsilon) * (sum(others) / len(others) + 1.0)


def overloaded(load: int, others: Sequence[int], epsilon: float, min_load: int = 0) -> bool:
    """Whether a session's bound worker at ``load`` is past the session load bound (never below
    ``min_load``, where small absolute numbers make ratios meaningless)."""
    return load >= min_load and load > session_bound(others, epsilon)
