"""gRPC Prefill servicer: translates pdserve.v1 messages to ``PrefillWorker`` calls and back."""

from __future__ import annotations

import grpc

from pdserve import tracing
from pdserve.server import abort_from
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.wire import cache_events_reply, sampling_from_proto, top_logprobs, worker_stats
from prefill_service.worker import PrefillWorker, Target


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, *, address: str, transports: list[str]) -> None:
        self.worker = worker
        self.address = address
        self.transports = transports

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        span = tracing.start("prefill.request", tracing.extract(request.trace_context), {
            "pdserve.worker": self.worker.worker_id, "pdserve.prompt_tokens": len(request.prompt_ids),
            "pdserve.kv_target": request.target.worker_id}, kind="server")
        started = tracing.now() if span is not None else 0.0
        try:
            if not request.request_id or not request.prompt_ids:
                raise ValueError("Prefill needs a request_id and a non-empty prompt")
            params = sampling_from_proto(request.sampling)
            t = request.target
            target = Target(worker_id=t.worker_id, kv_endpoint=bytes(t.kv_endpoint),
                            block_ids=list(t.block_ids), num_cached_tokens=t.num_cached_tokens,
                            transport=t.transport)
            res = await self.worker.prefill(request.request_id, list(request.prompt_ids), params, target)
        except Exception as exc:
            tracing.end(span, error=f"{type(exc).__name__}: {exc}")
            await abort_from(context, exc)
        if span is not None:
            _record_stages(span, started, res)
        facts = common_pb2.RequestFacts(
            prefill_worker=self.worker.worker_id, transport=res.transport, kv_blocks_sent=res.kv_blocks_sent,
            kv_bytes_sent=res.kv_bytes_sent, prefill_cached_tokens=res.num_cached_tokens,
            prefill_tier_tokens=res.num_tier_tokens,
            prefill_queue_ms=res.queue_s * 1e3, prefill_compute_ms=res.compute_s * 1e3,
            kv_transfer_ms=res.kv_transfer_s * 1e3, kv_wait_ms=res.kv_wait_s * 1e3)
        msg = prefill_pb2.PrefillResponse(first_token_id=res.first_token_id, facts=facts)
        if res.first_logprob is not None:
            msg.first_logprob = res.first_logprob
        if (top := top_logprobs(res.first_top)) is not None:
            msg.first_top_logprobs.CopyFrom(top)
        return msg

    async def Abort(self, request: prefill_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        return prefill_pb2.AbortResponse(found=await self.worker.abort(request.request_id))

    async def GetStats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        w = self.worker
        stats = worker_stats(worker_id=w.worker_id, role="prefill", incarnation=w.incarnation,
                             engine=w.engine.engine, snapshot=w.engine.snapshot, transports=self.transports,
                             kv_endpoint=b"", address=self.address,
                             num_running=max(w.engine.snapshot.num_running, len(w.in_flight)))
        cache = await cache_events_reply(request, w.engine.engine, w.engine.call)
        if cache is not None:
            stats.cache.CopyFrom(cache)
        return stats


def _record_stages(span, started: float, res) -> None:
    """The prefill's stages as child spans of ``span`` (measured by the worker; placed on this process's
    clock from when the call came in): engine queue, compute, and the KV push, which ends when the
    decode worker acknowledged it, ``kv_wait`` after the compute (a push layer by layer overlaps the
    compute)."""
    ctx = tracing.context_of(span)
    queued = started + res.queue_s
    computed = queued + res.compute_s
    tracing.record("prefill.queue", started, queued, ctx)
    tracing.record("prefill.compute", queued, computed, ctx, {
        "pdserve.computed_tokens": res.num_prompt_tokens - res.num_cached_tokens,
        "pdserve.cached_tokens": res.num_cached_tokens, "pdserve.tier_tokens": res.num_tier_tokens})
    if res.kv_blocks_sent:
        acked = computed + res.kv_wait_s
        tracing.record("kv.push", acked - res.kv_transfer_s, acked, ctx, {
            "pdserve.kv_bytes": res.kv_bytes_sent, "pdserve.kv_blocks": res.kv_blocks_sent,
            "pdserve.kv_transport": res.transport, "pdserve.kv_streamed": res.kv_streamed,
            "pdserve.kv_wait_ms": res.kv_wait_s * 1e3})
    tracing.end(span, {"pdserve.first_token": res.first_token_id})
