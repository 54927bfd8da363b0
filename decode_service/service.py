"""gRPC Decode servicer: translates pdserve.v1 messages to ``DecodeWorker`` calls and back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from decode_service.mux import DecodeManySession
from decode_service.worker import DecodeWorker
from engine.engine_types import failure
from pdserve import tracing
from pdserve.server import abort_from
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2
from pdserve.wire import cache_events_reply, sampling_from_proto, top_logprobs, worker_stats

DEFAULT_KV_WAIT_MS = 30_000


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, *, address: str, transports: list[str],
                 role: str = "decode", stream_interval: int = 1,
                 draining: asyncio.Event | None = None) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.worker = worker
        self.address = address
        self.transports = transports
        self.role = role  # "colocated": a colocated worker serving a router (local prefill only)
        # A message goes out once it holds this many tokens (a stream's first message and its last go at
        # once): fewer messages for the router to relay, burstier delivery (--stream-interval).
        self.stream_interval = stream_interval
        # set when the server starts draining: DecodeMany refuses new Allocates (and streams it did not
        # lease), serves the streams of requests leased before, and ends its call once what it carries
        # is done (the role hands in GrpcServer.draining)
        self.draining = draining if draining is not None else asyncio.Event()

    async def Allocate(self, request: decode_pb2.AllocateRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.allocation(request)
        except Exception as exc:
            await abort_from(context, exc)

    async def allocation(self, request: decode_pb2.AllocateRequest) -> decode_pb2.AllocateResponse:
        """One Allocate's answer; a failure raises (the caller turns it into a status)."""
        if not request.request_id or not request.prompt_ids:
            raise ValueError("Allocate needs a request_id and a non-empty prompt")
        params = sampling_from_proto(request.sampling)
        with tracing.span("decode.allocate", tracing.extract(request.trace_context), {
                "pdserve.worker": self.worker.worker_id, "pdserve.prompt_tokens": len(request.prompt_ids)},
                kind="server") as span:
            alloc = await self.worker.allocate(request.request_id, list(request.prompt_ids), params,
                                               request.lease_ms)
            if span is not None:
                span.set_attributes({"pdserve.cached_tokens": alloc.num_cached_tokens,
                                     "pdserve.tier_tokens": alloc.num_tier_tokens,
                                     "pdserve.blocks": len(alloc.block_ids)})
        return decode_pb2.AllocateResponse(
            worker_id=self.worker.worker_id, block_ids=alloc.block_ids,
            num_cached_tokens=alloc.num_cached_tokens, kv_endpoint=alloc.kv_endpoint,
            transports=self.transports, incarnation=self.worker.incarnation,
            num_tier_tokens=alloc.num_tier_tokens)

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        try:
            async for msg in self.responses(request):
                yield msg
        except Exception as exc:
            await abort_from(context, exc)

    async def DecodeMany(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        session = DecodeManySession(self.responses, self.allocation, self.draining,
                                    leased=self.worker.leases.__contains__)
        await session.serve(request_iterator, context)

    async def responses(self, request: decode_pb2.DecodeRequest) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """One request's Decode stream messages; a failure raises (the caller turns it into a status)."""
        span = tracing.start("decode.stream", tracing.extract(request.trace_context), {
            "pdserve.worker": self.worker.worker_id, "pdserve.prefill_locally": request.prefill_locally},
            kind="server")
        try:
            async for msg in self._responses(request, span):
                yield msg
        except BaseException as exc:
            tracing.end(span, error=f"{type(exc).__name__}: {exc}")
            raise
        tracing.end(span)

    async def _responses(self, request: decode_pb2.DecodeRequest,
                         span) -> AsyncIterator[decode_pb2.DecodeResponse]:
        wait_s = (request.kv_wait_ms or DEFAULT_KV_WAIT_MS) / 1000.0
        # The first token counts: it came from the prefill worker, or (local) it is in this stream.
        completion = 0 if request.prefill_locally else 1
        msg, first = decode_pb2.DecodeResponse(), True
        async for outs in self.worker.decode(request.request_id, request.first_token_id, wait_s,
                                             prefill_locally=request.prefill_locally):
            # Every output that was ready goes out as one message: under load the stream catches
            # up in one write instead of one per token (the proto carries several tokens).
            for out in outs:
                if out.finish_reason == "error":
                    raise failure(out)
                msg.token_ids.extend(out.new_token_ids)
                if out.new_logprobs:
                    msg.logprobs.extend(_logprob_list(out.new_logprobs))
                    # alternatives ride one entry per token, beside token_ids (logprobs > 0)
                    msg.top_logprobs.extend(t for t in map(top_logprobs, out.new_logprobs) if t)
                if out.finished:
                    msg.finish_reason = out.finish_reason or "stop"
            if not (first or msg.finish_reason or len(msg.token_ids) >= self.stream_interval):
                continue
            if first:  # the KV arrived (or the local prefill ran) and the first step is out
                tracing.event(span, "first_tokens", {"pdserve.tokens": len(msg.token_ids)})
            completion += len(msg.token_ids)
            if msg.finish_reason and span is not None:
                span.set_attributes({"pdserve.completion_tokens": completion,
                                     "pdserve.finish_reason": msg.finish_reason})
            msg.completion_tokens = completion
            yield msg
            msg, first = decode_pb2.DecodeResponse(), False

    async def Release(self, request: decode_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        found = await self.worker.release(request.request_id)
        return decode_pb2.ReleaseResponse(found=found)

    async def Abort(self, request: prefill_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        found = await self.worker.release(request.request_id)
        return prefill_pb2.AbortResponse(found=found)

    async def GetStats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        w = self.worker
        snap = w.engine.snapshot
        stats = worker_stats(worker_id=w.worker_id, role=self.role, incarnation=w.incarnation,
                             engine=w.engine.engine, snapshot=snap, transports=self.transports,
                             kv_endpoint=w.kv.endpoint(), address=self.address, num_leased=len(w.leases),
                             # in flight here: leased (waiting for KV) + decoding (from the KV wait on)
                             num_running=len(w.active) + len(w.leases))
        cache = await cache_events_reply(request, w.engine.engine, w.engine.call)
        if cache is not None:
            stats.cache.CopyFrom(cache)
        return stats


def _logprob_list(lps: list) -> list[float]:
    out = []
    for lp in lps:
        if isinstance(lp, (int, float)):
            out.append(float(lp))
        elif hasattr(lp, "logprob"):
            out.append(float(lp.logprob))
        elif isinstance(lp, (tuple, list)) and lp:
            out.append(float(lp[0]))
    return out
