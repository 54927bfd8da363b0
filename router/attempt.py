"""The pieces of one request attempt that ``router/pipeline.py`` composes: the failure it raises
(``RequestFailed``), the cleanup that returns both workers' blocks whatever happened (``_Cleanup``),
the mapping of a worker's gRPC status to the router's, the choice of KV transport, and the attempt's
facts as trace attributes."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from engine.prefix_hash import ROOT_HASH, block_hashes
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger(__name__)
CLEANUP_TIMEOUT_S = 5.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Cleanup:
    """Best-effort release of what a request may hold on both workers; runs at most once.

    A worker that is not answering its health polls (dead, or frozen with its connection open) gets
    its Release / Abort in the background: awaited, it would hold the request for up to
    ``CLEANUP_TIMEOUT_S`` before a migration or a retry elsewhere could start. What it held there is
    freed all the same: with the call (a dead process), at the end of its lease, or when a frozen
    worker resumes and finds the router's calls gone."""

    _background: set[asyncio.Task] = set()  # strong references until each finishes

    def __init__(self, p, d, request_id: str) -> None:
        self.p, self.d, self.rid = p, d, request_id
        self.done = False

    async def run(self, *, decode_reserved: bool, prefill_running: bool) -> None:
        if self.done:
            return
        self.done = True
        now, later = [], []
        if decode_reserved:
            (now if self.d.answering else later).append(self.d.stub.Release(
                decode_pb2.ReleaseRequest(request_id=self.rid), timeout=CLEANUP_TIMEOUT_S))
        if prefill_running and self.p is not None:
            (now if self.p.answering else later).append(self.p.stub.Abort(
                prefill_pb2.AbortRequest(request_id=self.rid), timeout=CLEANUP_TIMEOUT_S))
        if later:
            task = asyncio.ensure_future(asyncio.gather(*later, return_exceptions=True))
            _Cleanup._background.add(task)
            task.add_done_callback(_Cleanup._background.discard)
        with contextlib.suppress(Exception):
            await asyncio.shield(asyncio.gather(*now, return_exceptions=True))


def _held_hashes(prompt_hashes, prompt: list[int], answer: list[int], block_size: int) -> list[int]:
    """``block_hashes(prompt + answer)`` from the prompt's full blocks' hashes (computed at placement):
    only the blocks from the prompt's partial tail on are hashed again (a 2k-token prompt's 128 blocks
    cost ~0.25 ms of the router's loop a request)."""
    full = len(prompt_hashes)
    parent = prompt_hashes[-1] if full else ROOT_HASH
    return list(prompt_hashes) + block_hashes(prompt[full * block_size:] + answer, block_size, parent)


def _failed(exc: grpc.aio.AioRpcError, worker_id: str, what: str) -> RequestFailed:
    code = exc.code()
    msg = f"{what} on {worker_id} failed: {exc.details() or code.name}"
    err = RequestFailed(code, msg)
    err.extra_worker = worker_id if code in RETRYABLE else ""  # type: ignore[attr-defined]
    return err


class _DecodeLost(Exception):
    """The decode worker's DecodeMany call ended while the prefill pushed to it (``error``: its status)."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details())
        self.error = error


async def _unless_lost(call, lost: asyncio.Future):
    """``await call`` (a Prefill) unless ``lost`` resolves first: then the call is cancelled (the
    prefill worker aborts the request and its push) and ``_DecodeLost`` raised. Leaving any other way
    (the client gone, the deadline) cancels the call too, as awaiting it directly would."""
    task = asyncio.ensure_future(call)
    # Left by a cancellation in the same turn of the loop as the call failed, nobody would read the
    # call's error: asyncio would log "Task exception was never retrieved" with it.
    task.add_done_callback(_retrieved)
    try:
        await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()  # answered (or failed) first: as if awaited directly
        raise _DecodeLost(lost.result())
    finally:
        if not task.done():
            call.cancel()
            task.cancel()


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _prefill_failed(exc: grpc.aio.AioRpcError, prefill_id: str, decode_id: str) -> RequestFailed:
    """What a failed Prefill call means for the request. ABORTED (the decode worker released the
    request under the push: drained, lease gone) and NOT_FOUND (its KV receiver no longer knows the
    request: released while draining before the push arrived, or the worker restarted at the same
    address) say the prompt is fine and the destination is not: UNAVAILABLE with the decode worker
    blamed, so the request is placed again as after a dead decode worker. Anything else is the prefill
    worker's failure (``_failed``)."""
    if exc.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND):
        err = RequestFailed(grpc.StatusCode.UNAVAILABLE,
                            f"prefill on {prefill_id} failed: {exc.details() or exc.code().name}")
        err.extra_worker = decode_id  # type: ignore[attr-defined]
        return err
    return _failed(exc, prefill_id, "prefill")


def _fallback_kind(reason: str) -> str:
    """A bounded label for the fallbacks metric (the reason itself names workers)."""
    return "" if not reason else reason.split(" ", 1)[0] + "_unavailable"


def _choose_transport(prefill: list[str], decode: list[str]) -> tuple[str | None, str]:
    """First of the prefill worker's preferences that the decode worker also speaks."""
    common = [t for t in prefill if t in decode]
    if not common:
        return None, ""
    chosen = common[0]
    fallback = "" if chosen == (prefill[0] if prefill else chosen) else f"{prefill[0]} unavailable on decode"
    return chosen, fallback


def _span_facts(f: common_pb2.RequestFacts) -> dict[str, object]:
    """A request attempt's facts as span attributes (the path report's fields, pdserve.-prefixed)."""
    return {"pdserve.prefill_mode": f.prefill_mode, "pdserve.prefill_mode_reason": f.prefill_mode_reason,
            "pdserve.transport": f.transport, "pdserve.kv_bytes_sent": f.kv_bytes_sent,
            "pdserve.kv_blocks_sent": f.kv_blocks_sent, "pdserve.kv_blocks_reused": f.kv_blocks_reused,
            "pdserve.decode_tier_tokens": f.decode_tier_tokens,
            "pdserve.prefill_tier_tokens": f.prefill_tier_tokens,
            "pdserve.allocate_ms": f.allocate_ms, "pdserve.prefill_rpc_ms": f.prefill_rpc_ms,
            "pdserve.decode_ms": f.decode_ms}
