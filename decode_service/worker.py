"""The decode worker's logic: reservations under a lease, KV-complete wait, the decode stream.

Lifecycle of one request on this worker::

    allocate()  engine.reserve (reuses cached prefix blocks) → receiver.expect(missing blocks)
                → lease added (deadline = now + lease_ms)
    decode()    lease taken → await KV-complete (bounded) → engine.commit_prefilled(first token)
                → stream StepOutputs (all that are ready in one message) → engine.release (full
                blocks stay in the prefix cache, so a session's next turn finds them: that is how
                KV is "retained")
    decode(prefill_locally=True)   (conditional disaggregation, colocated workers behind a router)
                lease taken → receiver registration dropped (no KV is coming) → engine.release +
                engine.generate: the reservation becomes a full request; its cached prefix blocks
                are still in the prefix cache, so only the uncached suffix is computed here. Every
                token, the first included, comes from this engine.
    release()   lease popped → receiver.release + engine.release          (idempotent)
    reaper      every lease past its deadline is released the same way (prefill never delivered);
                it also names any request the engine holds that this worker does not track
                (``untracked``: neither allocating, leased nor decoding), which would be a leak

Any failure or cancellation on the way releases both the receiver registration and the engine
blocks, so free block counts always come back. That includes an Allocate cancelled (deadline,
client gone) while its reservation waits for the engine thread behind a forward pass: the queued
command runs all the same, so a release is queued behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from decode_service.leases import Lease, LeaseTable
from engine.async_engine import AsyncEngine
from engine.errors import UnknownRequest
from pdserve.settings import DEFAULT_LEASE_MS

log = logging.getLogger(__name__)
_UNTRACKED_CHECK_TICKS = 20  # reaper ticks (0.25 s) between checks for requests nobody tracks


@dataclass(frozen=True, kw_only=True)
class Allocation:
    block_ids: list[int]
    num_cached_tokens: int
    kv_endpoint: bytes
    num_tier_tokens: int = 0  # of num_cached_tokens, loading back from the KV tiers


class DecodeWorker:
    def __init__(self, *, engine: AsyncEngine, kv: Any, worker_id: str, block_size: int,
                 default_lease_ms: int = DEFAULT_LEASE_MS) -> None:
        self.engine = engine
        self.kv = kv  # kvtransfer adapter: endpoint(), expect(rid, blocks), wait(rid, timeout), release(rid)
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.block_size = block_size
        self.default_lease_ms = default_lease_ms
        self.leases = LeaseTable()
        self.active: set[str] = set()
        self._allocating: set[str] = set()  # between the duplicate check and the lease (or the undo)
        self._untracked_seen: set[str] = set()  # on the last check
        self._untracked_logged: set[str] = set()
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for rid in self.leases.ids():
            await self.release(rid)

    async def allocate(self, request_id: str, prompt_ids: list[int], params: Any,
                       lease_ms: int = 0) -> Allocation:
        if request_id in self.leases or request_id in self.active or request_id in self._allocating:
            raise ValueError(f"request {request_id!r} already allocated on {self.worker_id}")
        self._allocating.add(request_id)
        try:
            return await self._allocate(request_id, prompt_ids, params, lease_ms)
        finally:
            self._allocating.discard(request_id)

    async def _allocate(self, request_id: str, prompt_ids: list[int], params: Any,
                        lease_ms: int) -> Allocation:
        try:
            res = await self.engine.reserve(request_id, prompt_ids, params)
        except asyncio.CancelledError:
            # The reservation still runs on the engine thread (a queued command is not withdrawn)
            # and no lease would ever own its blocks: queue their release behind it, now. Nothing
            # else here holds this id (checked above), so this frees only what the reserve takes.
            with contextlib.suppress(Exception):  # a stopped engine holds nothing any more
                self.engine.release_soon(request_id).add_done_callback(_log_failed_release)
            raise
        block_ids = [int(b) for b in res.block_ids]
        cached = int(res.num_cached_tokens)
        missing = block_ids[cached // self.block_size:]
        try:
            if missing:
                await _maybe_await(self.kv.expect(request_id, missing))
            lease_s = (lease_ms or self.default_lease_ms) / 1000.0
            self.leases.add(Lease(request_id=request_id, block_ids=block_ids, num_cached_tokens=cached,
                                  num_prompt_tokens=len(prompt_ids), expects_kv=bool(missing),
                                  deadline=time.monotonic() + lease_s, prompt_ids=list(prompt_ids),
                                  params=params))
        except BaseException:
            await asyncio.shield(self._free(request_id, expects_kv=bool(missing)))
            raise
        return Allocation(block_ids=block_ids, num_cached_tokens=cached, kv_endpoint=self.kv.endpoint(),
                          num_tier_tokens=int(getattr(res, "num_tier_tokens", 0)))

    async def decode(self, request_id: str, first_token_id: int, kv_wait_s: float, *,
                     prefill_locally: bool = False) -> AsyncIterator[list[Any]]:
        """The request's StepOutputs, every one ready at once as one list (one stream message)."""
        lease = self.leases.take(request_id)
        if lease is None:
            raise UnknownRequest(f"no reservation for request {request_id!r} on {self.worker_id} "
                                 "(never allocated, released, or its lease expired)")
        self.active.add(request_id)
        try:
            if prefill_locally:
                if lease.expects_kv:  # nobody will push: stop expecting before the blocks are reused
                    await _maybe_await(self.kv.release(request_id))
                # Two engine-thread commands: a step in between may evict the freed prefix under
                # memory pressure, which only costs recomputing it (the output is the same).
                await self.engine.release(request_id)
                async for outs in self.engine.generate_ready(request_id, lease.prompt_ids, lease.params):
                    yield outs
                return
            if lease.expects_kv:
                await asyncio.wait_for(_maybe_await(self.kv.wait(request_id)), timeout=kv_wait_s)
                await _maybe_await(self.kv.release(request_id))
            async for outs in self.engine.commit_prefilled_ready(request_id, first_token_id):
                yield outs
        finally:
            self.active.discard(request_id)
            await asyncio.shield(self._free(request_id, expects_kv=lease.expects_kv))

    async def release(self, request_id: str) -> bool:
        lease = self.leases.take(request_id)
        if lease is None:
            if request_id in self.active:
                # Abort in the engine but keep the request's output stream registered: the Decode
                # stream then ends with finish_reason "abort" (AsyncEngine.abort drops the stream,
                # which left the RPC hanging until its deadline).
                await self.engine.call(lambda e: e.abort(request_id))
                return True
            return False
        await self._free(request_id, expects_kv=lease.expects_kv)
        return True

    async def _free(self, request_id: str, *, expects_kv: bool) -> None:
        if expects_kv:
            try:
                await _maybe_await(self.kv.release(request_id))
            except Exception:
                log.debug("kv release of %s failed", request_id, exc_info=True)
        try:
            await self.engine.release(request_id)
        except Exception:
            log.debug("engine release of %s failed", request_id, exc_info=True)

    async def untracked(self) -> dict[str, str]:
        """Requests the engine holds (id -> waiting / running / reserved / pinned) that this worker
        neither allocates, leases nor decodes: their blocks are lost to it. Empty when all is well;
        a request ending right now may show up once (its release is still queued)."""
        held = await self.engine.call(lambda e: e.request_states())
        return {rid: state for rid, state in held.items()
                if rid not in self.leases and rid not in self.active and rid not in self._allocating}

    async def _reap_forever(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(0.25)
            for lease in self.leases.expired():
                log.warning("lease of %s expired after %.1fs without KV; releasing its %d blocks",
                            lease.request_id, time.monotonic() - lease.created, len(lease.block_ids))
                await self._free(lease.request_id, expects_kv=lease.expects_kv)
            ticks += 1
            if ticks % _UNTRACKED_CHECK_TICKS == 0:
                await self._report_untracked()

    async def _report_untracked(self) -> None:
        """Log, once each, what the engine holds without an owner here when it is seen on two checks
        in a row (one check can catch a request whose release is still queued)."""
        try:
            now = await self.untracked()
        except Exception:  # a stopped engine: nothing to compare
            return
        lost = {rid: state for rid, state in now.items()
                if rid in self._untracked_seen and rid not in self._untracked_logged}
        self._untracked_logged = (self._untracked_logged | set(lost)) & set(now)
        if lost:
            log.error("engine holds %d request(s) that %s does not track (their KV blocks are lost "
                      "to it): %s", len(lost), self.worker_id,
                      ", ".join(f"{rid} ({state})" for rid, state in sorted(lost.items())[:16]))
        self._untracked_seen = set(now)


def _log_failed_release(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("release of a cancelled reservation failed: %r", fut.exception())


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value
