"""gRPC Router servicer (public API): admission → Pipeline events → GenerateResponse messages.

The servicer only translates: ``admission.admit`` validates, ``Pipeline.run`` drives the workers,
``TextAssembler`` turns ids into text deltas. ``GenerateStream`` (shared with the colocated role)
builds the response messages so both roles stream exactly the same shape.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor

import grpc

from pdserve import tracing
from pdserve.server import abort_from
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.admission import SESSION_METADATA_KEY, Admitted, ModelLimits, admit_async
from router.directory import WorkerDirectory
from router.latency import RequestClock
from router.pipeline import Done, FirstToken, Pipeline, RequestFailed, Tokens
from router.text import TextAssembler

log = logging.getLogger(__name__)


class GenerateStream:
    """Builds the GenerateResponse messages of one request."""

    def __init__(self, req: Admitted, tokenizer: object | None) -> None:
        self.req = req
        p = req.params
        ends = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(req.eos_token_ids))
        self.text = TextAssembler(tokenizer if req.want_text else None, p.stop,
                                  skip_special_tokens=req.skip_special_tokens, ends=ends)
        self.num_generated = 0

    def tokens(self, token_ids: list[int], logprobs: list[float] | None = None,
               top: list[common_pb2.TopLogprobs] | None = None) -> router_pb2.GenerateResponse:
        """``top``: one alternatives entry per token of ``token_ids`` (sampling.logprobs > 0), or none."""
        self.num_generated += len(token_ids)
        msg = router_pb2.GenerateResponse(request_id=self.req.request_id, token_ids=token_ids,
                                          text=self.text.push(token_ids))
        if logprobs:
            msg.logprobs.extend(logprobs)
        if top:
            msg.top_logprobs.extend(top)
        return msg

    def final(self, done: Done) -> router_pb2.GenerateResponse:
        m = done.meta
        final = router_pb2.FinalInfo(
            finish_reason=done.finish_reason,
            usage=common_pb2.Usage(prompt_tokens=len(self.req.prompt_ids),
                                   completion_tokens=done.completion_tokens or self.num_generated,
                                   cached_tokens=m.cached_tokens),
            facts=m.facts)
        return router_pb2.GenerateResponse(request_id=self.req.request_id, text=self.text.finish(),
                                           final=final)


async def generate_messages(pipeline: Pipeline, req: Admitted, tokenizer: object | None,
                            timeout: float | None, arrived: float | None = None,
                            ) -> AsyncIterator[router_pb2.GenerateResponse]:
    """The response messages of one admitted request: the path both doors (gRPC, HTTP) translate from.
    ``arrived``: ``time.perf_counter()`` when the request reached the router (default: now), where its
    latency histograms (router/latency.py) start.

    Raises RequestFailed with the router's status when the request cannot be served.
    """
    out = GenerateStream(req, tokenizer)
    clock = RequestClock(getattr(pipeline, "latency", None), arrived)
    # the request's span (pdserve/tracing.py): a child of the client's traceparent when it sent one
    span = tracing.start("pdserve.request", req.trace, {
        "pdserve.request_id": req.request_id, "pdserve.prompt_tokens": len(req.prompt_ids),
        "pdserve.max_tokens": req.params.max_tokens, "pdserve.session": bool(req.session_id)}, kind="server")
    if span is not None:
        req = dataclasses.replace(req, trace=tracing.context_of(span))
    error = "cancelled"
    try:
        async for event in pipeline.run(req, timeout):
            if isinstance(event, FirstToken):
                lps = [event.logprob] if event.logprob is not None else None
                yield out.tokens([event.token_id], lps, [event.top] if event.top is not None else None)
                clock.sent(1)
            elif isinstance(event, Tokens):
                yield out.tokens(event.token_ids, event.logprobs, event.top)
                clock.sent(len(event.token_ids))
            elif isinstance(event, Done):
                clock.done(event.meta.facts)
                tracing.end(span, {"pdserve.finish_reason": event.finish_reason,
                                   "pdserve.completion_tokens": event.completion_tokens,
                                   "pdserve.cached_tokens": event.meta.cached_tokens})
                span = None
                yield out.final(event)
    except RequestFailed as exc:
        error = f"{exc.code.name}: {exc.message}"
        raise
    finally:
        tracing.end(span, error=error)


def metadata_session(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_METADATA_KEY and value:
            return value if isinstance(value, str) else value.decode()
    return None


async def admit_or_abort(request, context, limits: ModelLimits, executor: Executor | None = None) -> Admitted:
    try:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline expired before admission")
        return await admit_async(request, limits, metadata_session(context), executor)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    raise AssertionError("unreachable")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, *, pipeline: Pipeline, directory: WorkerDirectory, limits: ModelLimits) -> None:
        self.pipeline = pipeline
        self.directory = directory
        self.limits = limits
        # Large prompts are tokenized here, two at a time, so they never take the event loop (nor
        # every thread of the loop's default executor).
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived = time.perf_counter()
        req = await admit_or_abort(request, context, self.limits, self.tokenize_pool)
        if tracing.enabled():  # the client's traceparent (gRPC metadata), continued by the request's span
            req = dataclasses.replace(req, trace=tracing.extract(context.invocation_metadata()))
        try:
            async for msg in generate_messages(self.pipeline, req, self.limits.tokenizer,
                                               context.time_remaining(), arrived):
                yield msg
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message, getattr(exc, "trailing_metadata", ()))
        except Exception as exc:
            await abort_from(context, exc)

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext):
        entries = []
        for h in self.directory.handles():
            entry = router_pb2.WorkerEntry(worker_id=h.worker_id, role=h.role, address=h.address,
                                           healthy=self.directory.is_healthy(h))
            if h.stats is not None:
                entry.stats.CopyFrom(h.stats)
            entries.append(entry)
        return router_pb2.ListWorkersResponse(workers=entries)
