"""The prefill worker's logic: compute a prompt's KV, push what the decode worker lacks, return token 1.

Lifecycle of one request on this worker::

    prefill()  engine.add_prefill_request (batched and chunked with the other prompts; reuses this
               worker's prefix cache) → "prefilled" StepOutput with the first sampled token
               → block_table → push blocks[skip:] into the decode worker's blocks[skip:], where
               skip = the decode worker's cached prefix (in blocks) → await the transfer's ack
               → engine.release (full blocks stay in the prefix cache for the next prompt)

Cancellation (the router gave up) aborts the engine request and the transfer; either way the
blocks are released, so this worker never keeps KV beyond its prefix cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Target:
    worker_id: str
    kv_endpoint: bytes
    block_ids: list[int]
    num_cached_tokens: int
    transport: str


@dataclass(frozen=True, kw_only=True)
class PrefillResult:
    first_token_id: int
    first_logprob: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_blocks_sent: int
    kv_bytes_sent: int
    transport: str
    kv_transfer_s: float = 0.0


class PrefillWorker:
    def __init__(self, *, engine: AsyncEngine, kv: Any, worker_id: str, block_size: int) -> None:
        self.engine = engine
        self.kv = kv  # kvtransfer adapter: async send(endpoint, rid, src, dst) -> (bytes, backend)
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.block_size = block_size
        self.in_flight: set[str] = set()

    async def prefill(self, request_id: str, prompt_ids: list[int], params: Any,
                      target: Target) -> PrefillResult:
        from pdserve.wire import first_logprob

        n_blocks = -(-len(prompt_ids) // self.block_size)
        if len(target.block_ids) != n_blocks:
            raise ValueError(f"target has {len(target.block_ids)} blocks, the prompt needs {n_blocks}")
        if target.num_cached_tokens % self.block_size or target.num_cached_tokens > len(prompt_ids):
            raise ValueError(f"bad num_cached_tokens {target.num_cached_tokens}")
        if request_id in self.in_flight:
            raise ValueError(f"request {request_id!r} is already being prefilled here")
        self.in_flight.add(request_id)
        try:
            out, table = await self.engine.prefill(request_id, prompt_ids, params)
            try:
                if out.finish_reason != "prefilled" or not out.new_token_ids:
                    raise RuntimeError(f"prefill of {request_id} ended with {out.finish_reason}: "
                                       f"{getattr(out, 'error', None) or 'no first token'}")
                skip = target.num_cached_tokens // self.block_size
                src, dst = table[skip:], list(target.block_ids[skip:])
                if len(src) != len(dst):
                    raise RuntimeError(f"block table has {len(table)} blocks, target {len(target.block_ids)}")
                nbytes, backend, t_send = 0, target.transport or self.kv.name, time.perf_counter()
                if src:
                    nbytes, backend = await self.kv.send(target.kv_endpoint, request_id, src, dst)
                # The router learns the pair's link bandwidth from bytes / this.
                transfer_s = time.perf_counter() - t_send if src else 0.0
                return PrefillResult(
                    first_token_id=int(out.new_token_ids[0]), first_logprob=first_logprob(out),
                    num_prompt_tokens=len(prompt_ids), num_cached_tokens=int(out.num_cached_tokens or 0),
                    kv_blocks_sent=len(src), kv_bytes_sent=int(nbytes), transport=backend,
                    kv_transfer_s=transfer_s)
            finally:
                await asyncio.shield(self.engine.release(request_id))
        finally:
            self.in_flight.discard(request_id)

    async def abort(self, request_id: str) -> bool:
        found = request_id in self.in_flight
        await self.engine.abort(request_id)
        return found
