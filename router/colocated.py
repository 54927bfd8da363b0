"""The `colocated` role: the public Router API served from one engine (prefill and decode together).

It is the baseline the disaggregated cluster is measured against, so it shares admission, text
assembly and the response shape with the router (``GenerateStream``); only the execution differs:
``AsyncEngine.generate`` runs the whole request in this process. Its ``Decode.GetStats`` (the only
Decode RPC it implements) reports the engine's load and free blocks, for tests and dashboards.
"""

from __future__ import annotations

import grpc

from engine.async_engine import AsyncEngine
from engine.engine_types import failure
from pdserve.server import abort_from
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.wire import first_logprob, top_logprobs, worker_stats
from router.admission import ModelLimits
from router.pipeline import Done, ServingMeta
from router.service import GenerateStream, admit_or_abort


class ColocatedServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, *, engine: AsyncEngine, limits: ModelLimits, worker_id: str, incarnation: str,
                 address: str) -> None:
        self.engine = engine
        self.limits = limits
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.address = address

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        req = await admit_or_abort(request, context, self.limits)
        out = GenerateStream(req, self.limits.tokenizer)
        # one engine, no router in front: nothing was placed, the prompt is prefilled where it decodes
        meta = ServingMeta(facts=common_pb2.RequestFacts(
            prefill_worker=self.worker_id, decode_worker=self.worker_id, transport="local",
            prefill_mode="local", prefill_mode_reason="no_prefill_pool"))
        try:
            async for step in self.engine.generate(req.request_id, req.prompt_ids, req.params):
                if step.finish_reason == "error":
                    raise failure(step)
                if step.num_cached_tokens:
                    meta.cached_tokens = int(step.num_cached_tokens)
                if step.new_token_ids:
                    lp = first_logprob(step)
                    top = [t for t in map(top_logprobs, step.new_logprobs or ()) if t]
                    yield out.tokens(list(step.new_token_ids), [lp] if lp is not None else None, top)
                if step.finished:
                    yield out.final(Done(step.finish_reason or "stop", out.num_generated, meta))
                    return
        except Exception as exc:
            await abort_from(context, exc)

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext):
        entry = router_pb2.WorkerEntry(worker_id=self.worker_id, role="colocated", address=self.address,
                                       healthy=True, stats=self.stats())
        return router_pb2.ListWorkersResponse(workers=[entry])

    def stats(self) -> common_pb2.WorkerStats:
        return worker_stats(worker_id=self.worker_id, role="colocated", incarnation=self.incarnation,
                            engine=self.engine.engine, snapshot=self.engine.snapshot, transports=[],
                            kv_endpoint=b"", address=self.address)

