"""Small factories and a simulated cluster for placement tests, simulations and the microbenchmark.

``SimCluster`` models what matters to placement without running a model: every worker has a
bounded LRU of block hashes (its prefix cache / retained session KV), computed with the engine's
real ``block_hashes``; running a request on a pair reports, like the real services would, how
many blocks each side already held and how many bytes had to move.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.prefix_hash import block_hashes
from router.placement.types import Outcome, Placement, PlacementRequest, WorkerInfo


def workers(n_prefill: int, n_decode: int, incarnation: str = "i1") -> list[WorkerInfo]:
    out = [WorkerInfo(f"p{i}", "prefill", f"10.0.0.{i}:7001", incarnation, "L") for i in range(n_prefill)]
    out += [WorkerInfo(f"d{i}", "decode", f"10.0.1.{i}:7002", incarnation, "L") for i in range(n_decode)]
    return out


def request(rid: str, tokens: list[int], block_size: int = 16, session_id: str | None = None,
            reusable_prefix_len: int | None = None) -> PlacementRequest:
    return PlacementRequest(request_id=rid, session_id=session_id,
                            block_hashes=block_hashes(tokens, block_size), prompt_len=len(tokens),
                            reusable_prefix_len=reusable_prefix_len)


class LRUBlocks:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def leading_hits(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass
class SimStats:
    prompt_blocks: int = 0
    prefill_hit_blocks: int = 0
    decode_hit_blocks: int = 0
    bytes_sent: int = 0
    bytes_no_reuse: int = 0
    per_worker: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        """Share of prompt blocks the decode side already held (what need not be sent)."""
        return self.decode_hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def prefill_hit_ratio(self) -> float:
        return self.prefill_hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


class SimCluster:
    def __init__(self, infos: list[WorkerInfo], *, capacity_blocks: int, block_size: int = 16,
                 bytes_per_block: int = 64 * 1024, bandwidth_Bps: float = 1e9) -> None:
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.bandwidth = bandwidth_Bps
        self.caches = {w.worker_id: LRUBlocks(capacity_blocks) for w in infos}
        self.stats = SimStats()

    def run(self, req: PlacementRequest, pl: Placement, generated: list[int] | None = None,
            prompt_tokens: list[int] | None = None) -> Outcome:
        """Serve ``req`` on the placed pair; returns the Outcome a real cluster would report."""
        hashes = list(req.block_hashes)
        pc, dc = self.caches[pl.prefill.worker_id], self.caches[pl.decode.worker_id]
        p_hit, d_hit = pc.leading_hits(hashes), dc.leading_hits(hashes)
        sent = len(hashes) - d_hit
        limit = len(hashes) if req.reusable_prefix_len is None else min(
            len(hashes), req.reusable_prefix_len // self.block_size)
        pc.insert(hashes[:limit])
        held = hashes
        if generated is not None and prompt_tokens is not None:
            held = block_hashes(prompt_tokens + generated, self.block_size)
        dc.insert(held if req.reusable_prefix_len is None else held[:limit])
        s = self.stats
        s.prompt_blocks += len(hashes)
        s.prefill_hit_blocks += p_hit
        s.decode_hit_blocks += d_hit
        s.bytes_sent += sent * self.bytes_per_block
        s.bytes_no_reuse += len(hashes) * self.bytes_per_block
        s.per_worker[pl.decode.worker_id] = s.per_worker.get(pl.decode.worker_id, 0) + 1
        s.per_worker[pl.prefill.worker_id] = s.per_worker.get(pl.prefill.worker_id, 0) + 1
        nbytes = sent * self.bytes_per_block
        return Outcome(success=True, decode_block_hashes=held, decode_cached_blocks=d_hit,
                       prefill_block_hashes=hashes[:limit], prefill_cached_blocks=p_hit,
                       blocks_sent=sent, bytes_sent=nbytes, transfer_s=nbytes / self.bandwidth)


def chat_tokens(rng: random.Random, n: int, vocab: int = 32000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]
