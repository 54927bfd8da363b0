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

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from engine.prefix_hash import ROOT_HASH, block_hashes
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from pdserve.wire import sampling_to_proto
from router.admission import Admitted
from router.conditional import ConditionalConfig, Decision, PrefillModePolicy
from router.directory import WorkerDirectory
from router.migration import EventKinds, Migration
from router.placement import NoWorkersAvailable, Outcome, Placement, PlacementRequest, Placer
from router.shedding import Admission, AdmissionConfig, Refused

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
CLEANUP_TIMEOUT_S = 5.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
        try:
            # an Allocate call, or a share of the worker's DecodeMany call: the same answer either way
            allocate = lambda: d.decode.allocate(decode_pb2.AllocateRequest(
                request_id=req.request_id, prompt_ids=req.prompt_ids, sampling=sampling,
                lease_ms=self.lease_ms), timeout)
            # waits in the router's queue (bounded) while D has no free blocks
            alloc = await self.admission.allocate(d.worker_id, allocate, timeout)
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc, d.worker_id, "decode Allocate") from None
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
        try:
            call = p.stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=req.request_id, prompt_ids=req.prompt_ids, sampling=sampling,
                target=prefill_pb2.KVTarget(worker_id=d.worker_id, kv_endpoint=alloc.kv_endpoint,
                                            block_ids=list(alloc.block_ids),
                                            num_cached_tokens=alloc.num_cached_tokens, transport=transport)),
                timeout=timeout)
            res = await (call if hold is None else _unless_lost(call, hold.lost))
        except _DecodeLost as lost:
            self.placer.prefill_done(req.request_id)
            raise _failed(lost.error, d.worker_id, "decode worker (under the prefill's push)") from None
        except grpc.aio.AioRpcError as exc:
            self.placer.prefill_done(req.request_id)  # no sample: the call failed
            raise _prefill_failed(exc, p.worker_id, d.worker_id) from None
        except BaseException:  # cancelled (client gone, deadline): out of the queue estimate all the same
            self.placer.prefill_done(req.request_id)
            raise
        finally:
            if hold is not None:
                hold.release()
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
        request = decode_pb2.DecodeRequest(request_id=req.request_id, first_token_id=first_token_id,
                                           kv_wait_ms=self.lease_ms, prefill_locally=local)
        try:
            # one Decode call, or a share of the worker's DecodeMany call: the same messages either way
            async with contextlib.aclosing(d.decode.stream(request, timeout)) as stream:
                async for msg in stream:
                    if msg.token_ids:
                        yield Tokens(list(msg.token_ids), list(msg.logprobs), list(msg.top_logprobs))
                    if msg.finish_reason:
                        yield (msg.finish_reason, msg.completion_tokens)
                        return
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc, d.worker_id, "decode") from None

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
