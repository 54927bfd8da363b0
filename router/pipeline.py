"""Drive one request through the disaggregated path: place → Allocate → Prefill → Decode.

Lifecycle of one request (yielded as events to the servicer)::

    place (Placer)          pick (prefill P, decode D); failures before the first token are retried
      │                     on other workers (UNAVAILABLE / RESOURCE_EXHAUSTED exclude the culprit)
    D.Allocate              reserve blocks under a lease; D reports its cached prefix
    P.Prefill               P computes the uncached suffix, pushes D's missing blocks, returns token 1
      │ ──▶ FirstToken      streamed to the client at once (TTFT = queue + prefill + transfer)
    D.Decode (stream)       D waits for KV-complete, joins its batch ──▶ Tokens ... ──▶ Done(meta)

Local prefill (``router/conditional.py``): right after Allocate, ``decide`` weighs both paths with
the router's cost model (D's cached prefix, both queues, the (P, D) link, D's load); when it says
local (always, when the router fronts colocated workers and has no prefill pool), Prefill is skipped
and ``Decode(prefill_locally=True)`` makes D compute the prompt itself: D's stream then carries
token 1 too (TTFT = D's prefill), and the final message says ``prefill_mode="local"`` with the
reason. Token 1 comes from D's engine, so greedy and seeded output equal one engine's either way.

Cleanup is the point of this module: whatever stage fails or is cancelled (client went away,
deadline, dead worker), the ``finally`` releases D's reservation / aborts P's request, so both
pools' free block counts return. A dead decode worker mid-stream ends the request with UNAVAILABLE
and is taken out of placement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from engine.prefix_hash import block_hashes
from pdserve import tracing
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from pdserve.wire import sampling_to_proto
from router.admission import Admitted
from router.attempt import (
    RETRYABLE,
    RequestFailed,
    _choose_transport,
    _Cleanup,
    _DecodeLost,
    _failed,
    _fallback_kind,
    _held_hashes,
    _prefill_failed,
    _span_facts,
    _unless_lost,
)
from router.conditional import ConditionalConfig, Decision, PrefillModePolicy
from router.directory import WorkerDirectory
from router.migration import EventKinds, Migration
from router.placement import NoWorkersAvailable, Outcome, Placement, PlacementRequest, Placer
from router.shedding import Admission, AdmissionConfig, Refused

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    logprob: float | None
    top: common_pb2.TopLogprobs | None = None  # its alternatives (sampling.logprobs > 0)


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    logprobs: list[float]
    top: list[common_pb2.TopLogprobs] = field(default_factory=list)  # one per token, or none


@dataclass(kw_only=True)
class ServingMeta:
    """What one request's path reports: ``facts`` travel to the client as they are (FinalInfo.facts;
    the prefill worker's share merged in from its PrefillResponse), ``cached_tokens`` goes to Usage."""

    facts: common_pb2.RequestFacts = field(default_factory=common_pb2.RequestFacts)
    cached_tokens: int = 0


@dataclass(frozen=True)
class Done:
    finish_reason: str
    completion_tokens: int
    meta: ServingMeta


_EVENTS = EventKinds(first=FirstToken, tokens=Tokens, done=Done, failed=RequestFailed, meta=ServingMeta)


class Pipeline:
    def __init__(self, directory: WorkerDirectory, placer: Placer, *, block_size: int, lease_ms: int,
                 conditional: ConditionalConfig | None = None) -> None:
        self.directory = directory
        self.placer = placer
        self.latency = placer.metrics.latency  # the request histograms both doors observe (router/latency.py)
        self.block_size = block_size
        self.lease_ms = lease_ms
        # a request outlives a worker: continued elsewhere, token-exact (router/migration.py);
        # bootstrap installs the configured one
        self.migration = Migration()
        # admission control (router/shedding.py); bootstrap installs the configured one
        self.admission = Admission(AdmissionConfig(), placer)
        self.local = PrefillModePolicy(conditional, placer)

    def run(self, req: Admitted, timeout: float | None) -> AsyncIterator[object]:
        """Events of one request, continued on other workers when one fails under it (the migration's
        own generator, not one wrapped around it: every token passes through each layer)."""
        return self.migration.run(req, timeout, self._run_once, _EVENTS)

    async def _run_once(self, req: Admitted, timeout: float | None) -> AsyncIterator[object]:
        preq = PlacementRequest(request_id=req.request_id, session_id=req.session_id,
                                block_hashes=block_hashes(req.prompt_ids, self.block_size),
                                prompt_len=len(req.prompt_ids), reusable_prefix_len=req.reusable_prefix_len)
        exclude: set[str] = set()
        last: RequestFailed | None = None
        sampling = sampling_to_proto(req.params)
        try:
            for _attempt in range(MAX_ATTEMPTS):
                placing = time.perf_counter()
                try:
                    placement: Placement = await self.placer.aplace(preq, exclude=frozenset(exclude))
                except NoWorkersAvailable as exc:
                    raise last or RequestFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                self.placer.metrics.latency.placement.observe(time.perf_counter() - placing)
                # Both handles stay usable until this attempt's last cleanup RPC, even if discovery
                # removes the worker meanwhile (directory.py: drain, not cut).
                remote = placement.prefill is not None  # else no prefill pool: D prefills
                p = self.directory.acquire(placement.prefill.worker_id) if remote else None
                d = self.directory.acquire(placement.decode.worker_id)
                try:
                    if (remote and p is None) or d is None:
                        pairs = ((placement.prefill, p), (placement.decode, d))
                        exclude.update(w.worker_id for w, h in pairs if w is not None and h is None)
                        continue
                    wait_est = self.admission.check(req.request_id, placement, timeout)  # or Refused
                    attempt = self._attempt(req, preq, placement, sampling, p, d, timeout, wait_est)
                    try:
                        async for event in attempt:
                            if isinstance(event, RequestFailed):  # retryable, before the first token
                                exclude.add(event.extra_worker)
                                last = event
                                break
                            yield event
                        else:
                            return
                    finally:
                        await attempt.aclose()  # its cleanup RPCs run now, while the handles are held
                finally:
                    if d is not None:
                        self.admission.freed(d.worker_id)  # its blocks are back: queued Allocates retry
                    for h in (p, d):
                        if h is not None:
                            self.directory.release(h)
            raise last or RequestFailed(grpc.StatusCode.UNAVAILABLE, "no worker could serve the request")
        except Refused as exc:  # full now: RESOURCE_EXHAUSTED, and when to come back
            failed = RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message)
            failed.trailing_metadata = exc.trailing_metadata()  # type: ignore[attr-defined]
            raise failed from None
        finally:
            # Every placement is closed: on_result where the outcome is known, this on every other
            # path (client gone, deadline, unexpected error), so no in-flight count leaks.
            self.placer.forget_request(req.request_id)

    async def _attempt(self, req: Admitted, preq: PlacementRequest, placement: Placement, sampling,
                       p, d, timeout: float | None, wait_est_s: float = 0.0) -> AsyncIterator[object]:
        meta = ServingMeta(facts=common_pb2.RequestFacts(
            prefill_worker=p.worker_id if p else d.worker_id, decode_worker=d.worker_id,
            prefill_mode="remote",
            placement_policy=placement.policy, session_moved=placement.session_moved,
            session_hit=placement.session_hit, moved_from=placement.moved_from_str,
            move_reason=placement.move_reason, decode_load=placement.decode_load,
            decode_load_cap=placement.decode_load_cap, admission_wait_est_ms=wait_est_s * 1e3))
        state = _Cleanup(p, d, req.request_id)
        span = tracing.start("pdserve.attempt", req.trace, {
            "pdserve.request_id": req.request_id, "pdserve.prefill_worker": p.worker_id if p else "",
            "pdserve.decode_worker": d.worker_id, "pdserve.placement": placement.reason,
            "pdserve.session_hit": placement.session_hit, "pdserve.session_moved": placement.session_moved,
            "pdserve.move_reason": placement.move_reason, "pdserve.continuation": "~r" in req.request_id})
        if span is not None:
            req = dataclasses.replace(req, trace=tracing.context_of(span))
        try:
            phases = self._attempt_phases(req, preq, placement, sampling, p, d, timeout, meta, state)
            async for event in phases:
                yield event
        except BaseException as exc:
            tracing.end(span, error=f"{type(exc).__name__}: {exc}")
            raise
        tracing.end(span, _span_facts(meta.facts))

    async def _attempt_phases(self, req: Admitted, preq: PlacementRequest, placement: Placement, sampling,
                              p, d, timeout: float | None, meta: ServingMeta, state) -> AsyncIterator[object]:
        try:
            first = await self._prefill_phase(req, placement, sampling, p, d, meta, timeout)
        except RequestFailed as exc:
            await state.run(decode_reserved=True, prefill_running=True)
            failed = getattr(exc, "extra_worker", "")
            # Capacity is not sickness: a full worker (RESOURCE_EXHAUSTED) is only skipped by this
            # request's retry; only a dead one (UNAVAILABLE) leaves placement for the cooldown.
            sick = failed if exc.code == grpc.StatusCode.UNAVAILABLE else ""
            self._feedback(preq, placement, meta, success=False, error=exc.message, failed=sick)
            if exc.code in RETRYABLE and failed:
                yield exc
                return
            raise
        except BaseException:
            await state.run(decode_reserved=True, prefill_running=True)
            raise
        local = first is None  # D computes the prompt: its stream carries token 1 as well
        generated: list[int] = []
        first_at = time.monotonic()  # token 1 is here (remote); a local prefill resets it when it comes
        try:
            if not local:
                yield first
                generated.append(first.token_id)
            async for event in self._decode_phase(req, d, 0 if local else first.token_id, timeout, local):
                if isinstance(event, Tokens):
                    if local and not generated:  # token 1 of a local prefill: this is the TTFT
                        first_at = time.monotonic()
                        self.placer.prefill_done(req.request_id, answered=True)
                        lps = event.logprobs
                        top = event.top
                        yield FirstToken(event.token_ids[0], lps[0] if lps else None, top[0] if top else None)
                        if len(event.token_ids) > 1:
                            yield Tokens(event.token_ids[1:], lps[1:], top[1:])
                    else:
                        yield event
                    generated.extend(event.token_ids)
                    continue
                reason, completion = event
                meta.facts.decode_ms = (time.monotonic() - first_at) * 1e3
                state.done = True  # the decode worker freed everything itself
                # What the decode worker keeps for the session: the prompt and the answer, so the
                # next turn (prompt + answer + new text) finds this turn's KV there. The last token
                # was sampled but never fed back, so its KV does not exist (a block ending on it
                # is not full there).
                held = _held_hashes(preq.block_hashes, req.prompt_ids, generated[:-1], self.block_size)
                self._feedback(preq, placement, meta, success=True, decode_hashes=held)
                yield Done(reason, completion, meta)
                return
        except RequestFailed as exc:
            dead = exc.code == grpc.StatusCode.UNAVAILABLE
            if dead:
                self.directory.mark_failed_id(d.worker_id)
            self._feedback(preq, placement, meta, success=False, error=exc.message,
                           failed=d.worker_id if dead else "")
            if local and not generated and exc.code in RETRYABLE:
                # Nothing reached the client yet: like a failed prefill, another worker may serve it.
                await state.run(decode_reserved=True, prefill_running=False)
                yield exc
                return
            raise
        finally:
            await state.run(decode_reserved=True, prefill_running=False)
        raise RequestFailed(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    async def _prefill_phase(self, req: Admitted, placement: Placement, sampling, p, d, meta: ServingMeta,
                             timeout: float | None) -> FirstToken | None:
        """Allocate on D, then Prefill on P (token 1), or None: D prefills locally (conditional)."""
        t0 = time.monotonic()
        with tracing.span("pdserve.allocate", req.trace, {"pdserve.decode_worker": d.worker_id},
                          kind="client") as span:
            trace = tracing.inject(tracing.context_of(span))
            try:
                # an Allocate call, or a share of the worker's DecodeMany call: the same answer either way
                allocate = lambda: d.decode.allocate(decode_pb2.AllocateRequest(
                    request_id=req.request_id, prompt_ids=req.prompt_ids, sampling=sampling,
                    lease_ms=self.lease_ms, trace_context=trace), timeout)
                # waits in the router's queue (bounded) while D has no free blocks
                alloc = await self.admission.allocate(d.worker_id, allocate, timeout)
            except grpc.aio.AioRpcError as exc:
                raise _failed(exc, d.worker_id, "decode Allocate") from None
            tracing.end(span, {"pdserve.cached_tokens": alloc.num_cached_tokens,
                               "pdserve.tier_tokens": alloc.num_tier_tokens})
        t1 = time.monotonic()
        f = meta.facts
        f.allocate_ms = (t1 - t0) * 1e3
        f.kv_blocks_reused = alloc.num_cached_tokens // self.block_size
        f.decode_tier_tokens = alloc.num_tier_tokens
        f.predicted_decode_blocks = placement.predicted_decode_cached_blocks
        decision: Decision = self.local.decide(req.request_id, len(req.prompt_ids), alloc.num_cached_tokens,
                                               placement)
        f.prefill_mode_reason = decision.reason
        if decision.local:
            f.prefill_mode, f.transport, f.prefill_worker = "local", "local", d.worker_id
            meta.cached_tokens = alloc.num_cached_tokens
            return None
        transport, fallback = _choose_transport(list(p.stats.transports) if p.stats else [],
                                                list(alloc.transports))
        if transport is None:
            err = RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no common KV transport: prefill {list(p.stats.transports)}, "
                                f"decode {list(alloc.transports)}")
            raise err
        f.transport, f.fallback, f.fallback_reason = transport, bool(fallback), fallback
        # D's DecodeMany call may break (D died) or be given up (D froze; without a call, D failing a
        # poll under a long push) while P pushes to it: then the Prefill is cancelled and the request
        # placed again, rather than waiting for the push to fail
        hold = d.decode.hold(req.request_id) if d.decode is not None else None
        span = tracing.start("pdserve.prefill", req.trace, {"pdserve.prefill_worker": p.worker_id,
                                                            "pdserve.kv_transport": transport}, kind="client")
        try:
            call = p.stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=req.request_id, prompt_ids=req.prompt_ids, sampling=sampling,
                target=prefill_pb2.KVTarget(worker_id=d.worker_id, kv_endpoint=alloc.kv_endpoint,
                                            block_ids=list(alloc.block_ids),
                                            num_cached_tokens=alloc.num_cached_tokens, transport=transport),
                trace_context=tracing.inject(tracing.context_of(span))),
                timeout=timeout)
            res = await (call if hold is None else _unless_lost(call, hold.lost))
        except _DecodeLost as lost:
            self.placer.prefill_done(req.request_id)
            tracing.end(span, error="the decode worker was lost under the push")
            raise _failed(lost.error, d.worker_id, "decode worker (under the prefill's push)") from None
        except grpc.aio.AioRpcError as exc:
            self.placer.prefill_done(req.request_id)  # no sample: the call failed
            tracing.end(span, error=f"{exc.code().name}: {exc.details()}")
            raise _prefill_failed(exc, p.worker_id, d.worker_id) from None
        except BaseException:  # cancelled (client gone, deadline): out of the queue estimate all the same
            self.placer.prefill_done(req.request_id)
            tracing.end(span, error="cancelled")
            raise
        finally:
            if hold is not None:
                hold.release()
        tracing.end(span, {"pdserve.kv_bytes": res.facts.kv_bytes_sent,
                           "pdserve.cached_tokens": res.facts.prefill_cached_tokens})
        got = res.facts
        self.placer.prefill_done(req.request_id, worker_id=p.worker_id,
                                 compute_s=got.prefill_compute_ms / 1e3, push_wait_s=got.kv_wait_ms / 1e3,
                                 computed_tokens=len(req.prompt_ids) - got.prefill_cached_tokens)
        f.prefill_rpc_ms = (time.monotonic() - t1) * 1e3
        f.MergeFrom(got)  # the prefill worker's share: what it set overrides
        meta.cached_tokens = max(got.prefill_cached_tokens, alloc.num_cached_tokens)
        return FirstToken(res.first_token_id, res.first_logprob if res.HasField("first_logprob") else None,
                          res.first_top_logprobs if res.HasField("first_top_logprobs") else None)

    async def _decode_phase(self, req: Admitted, d, first_token_id: int, timeout: float | None,
                            local: bool = False) -> AsyncIterator[object]:
        span = tracing.start("pdserve.decode", req.trace, {"pdserve.decode_worker": d.worker_id,
                                                           "pdserve.prefill_locally": local}, kind="client")
        request = decode_pb2.DecodeRequest(request_id=req.request_id, first_token_id=first_token_id,
                                           kv_wait_ms=self.lease_ms, prefill_locally=local,
                                           trace_context=tracing.inject(tracing.context_of(span)))
        tokens, opened = 0, time.perf_counter()
        try:
            # one Decode call, or a share of the worker's DecodeMany call: the same messages either way
            async with contextlib.aclosing(d.decode.stream(request, timeout)) as stream:
                async for msg in stream:
                    if msg.token_ids:
                        if not tokens:
                            self.latency.decode_join.labels("local" if local else "remote").observe(
                                time.perf_counter() - opened)
                        tokens += len(msg.token_ids)
                        yield Tokens(list(msg.token_ids), list(msg.logprobs), list(msg.top_logprobs))
                    if msg.finish_reason:
                        tracing.end(span, {"pdserve.tokens": tokens,
                                           "pdserve.finish_reason": msg.finish_reason})
                        span = None
                        yield (msg.finish_reason, msg.completion_tokens)
                        return
        except grpc.aio.AioRpcError as exc:
            tracing.end(span, error=f"{exc.code().name}: {exc.details()}")
            span = None
            raise _failed(exc, d.worker_id, "decode") from None
        finally:
            tracing.end(span, {"pdserve.tokens": tokens})  # cancelled, or ended without a reason

    def _feedback(self, preq: PlacementRequest, placement: Placement, meta: ServingMeta, *, success: bool,
                  error: str = "", failed: str = "", decode_hashes: list[int] | None = None) -> None:
        f = meta.facts
        try:
            self.placer.on_result(preq, placement, Outcome(
                success=success, decode_block_hashes=decode_hashes,
                # a locally prefilled prompt never reached the prefill worker's cache
                prefill_block_hashes=list(preq.block_hashes) if f.prefill_mode == "remote" else None,
                decode_cached_blocks=f.kv_blocks_reused,
                prefill_cached_blocks=f.prefill_cached_tokens // self.block_size,
                blocks_sent=f.kv_blocks_sent, bytes_sent=f.kv_bytes_sent, transfer_s=f.kv_transfer_ms / 1e3,
                transport=f.transport, fallback=_fallback_kind(f.fallback_reason),
                error=error, failed_worker_id=failed))
        except Exception:
            log.exception("placer.on_result failed")
