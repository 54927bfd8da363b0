"""The router's end of DecodeMany: every Allocate and Decode stream to one decode worker on one call.

Why: an Allocate call and a Decode call per request cost the router two call set-ups and, per
token, one message to read for each stream; gRPC's per-call and per-message costs are most of the
router's CPU (docs/cluster.md, "The gRPC floor"). On one long-lived DecodeMany call a request is an
``AllocateCall`` and later a ``DecodeStart`` in messages that may carry others', and one response
carries every stream's update of an engine step and every Allocate answer that was ready
(``decode_service/mux.py`` is the worker's end).

``DecodeStreams.allocate(request, timeout)`` returns what an Allocate call would, and
``DecodeStreams.stream(request, timeout)`` yields the ``DecodeResponse`` messages a Decode call
would; both raise ``grpc.aio.AioRpcError`` with the status that call would have ended with, so the
pipeline cannot tell the two apart.

Lifecycle of a call (``_Call``)::

    opened      by the first Allocate or stream when none is open (or the last one broke)
    writer      sends every queued Allocate, start and cancel as one message when woken
    reader      resolves each Allocate's future and hands each update to its stream's queue; one for
                a request no longer waited for (cancelled, timed out) is dropped
    Allocate    registered -> queued -> its answer or status; given up (client gone, deadline) it
                queues a cancel (the worker frees what it reserved; the pipeline's Release covers an
                answer already on its way), or is dropped unsent if the writer has not sent it yet
    held        an Allocate answered, its prompt on a prefill worker that pushes the KV here
                (``hold``): nothing is sent for it, but it waits on this worker all the same; when the
                call breaks or is given up, its ``lost`` future gets the call's status and the
                pipeline cancels the Prefill instead of letting the push wait on a dead or frozen
                receiver
    stream      registered -> start queued -> updates until finish_reason or a status ->
                unregistered; leaving early (client gone, deadline, error) queues a cancel, which
                frees the request on the worker as a cancelled Decode call would; updates that
                queued up behind a busy router go on as one message
    broken      the worker died, was restarted or finished draining: every request on the call gets
                UNAVAILABLE (``_call_status``; CANCELLED and UNIMPLEMENTED as they are), so the router
                places it again or migrates it; the next request opens a new call, to whatever
                incarnation answers now
    no call     (``--decode-mux off``, an older worker) a held request is lost when the worker fails a
                health poll while it has been held ``UNRESPONSIVE_S`` or more (``unresponsive``)
    abandoned   the worker stopped answering its health polls while requests wait on a call that has
                carried nothing for ``UNRESPONSIVE_S`` (``DecodeStreams.unresponsive``, from the
                directory): a frozen process (SIGSTOP, a hung driver call) keeps its TCP connection,
                so nothing else ends the call before gRPC's keepalive (10 + 5 s) does; the call is
                broken as above, with UNAVAILABLE saying so

A worker without DecodeMany (UNIMPLEMENTED: an older build) is remembered and served by one call per
Allocate and stream from then on; ``enabled=False`` (``--decode-mux off``) does the same for all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import CollectorRegistry, Counter

from pdserve.v1 import decode_pb2

log = logging.getLogger(__name__)
_DEADLINE = object()  # queued by a stream's deadline timer: the stream ends DEADLINE_EXCEEDED
# A call with requests waiting that carried nothing for this long, from a worker that also failed its
# health poll, is given up (``DecodeStreams.unresponsive``): a decode worker with streams sends a
# message every engine step, and one with only Allocates waiting answers them in milliseconds.
UNRESPONSIVE_S = 3.0


class MuxMetrics:
    """``pdserve_router_decode_mux_{calls,broken,abandoned,messages,updates}_total``: calls opened, calls
    that ended under requests, calls given up on a worker that stopped answering, responses received
    and the Allocate answers and stream updates they carried (updates / messages: how many requests one
    response served)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.calls = Counter("pdserve_router_decode_mux_calls", "DecodeMany calls opened", registry=registry)
        self.broken = Counter("pdserve_router_decode_mux_broken", "DecodeMany calls that ended under "
                              "requests (they were placed again or migrated)", registry=registry)
        self.abandoned = Counter("pdserve_router_decode_mux_abandoned", "DecodeMany calls given up: the "
                                 "worker failed its health poll and the call carried nothing while "
                                 "requests waited on it", registry=registry)
        self.messages = Counter("pdserve_router_decode_mux_messages", "DecodeMany responses received",
                                registry=registry)
        self.updates = Counter("pdserve_router_decode_mux_updates", "Allocate answers and stream updates "
                               "those responses carried", registry=registry)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error an Allocate or Decode call would have raised with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _status_error(code: int, message: str) -> grpc.aio.AioRpcError:
    """A status the worker sent for one request (AllocateResult / DecodeUpdate ``code``) as its error."""
    return rpc_error(_CODES.get(code, grpc.StatusCode.UNKNOWN), message)


class Hold:
    """A request held on a decode worker while it prefills elsewhere (``DecodeStreams.hold``), in the
    table it waits in: its DecodeMany call's ``held``, or without a call the worker's own. ``lost``
    gets an UNAVAILABLE status if the worker is lost meanwhile."""

    def __init__(self, table: dict[str, Hold], request_id: str) -> None:
        self._table, self._rid = table, request_id
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
        self.since = time.monotonic()

    def release(self) -> None:
        if self._table.get(self._rid) is self:
            del self._table[self._rid]


class _Call:
    """One DecodeMany call and the requests allocating and streaming on it."""

    def __init__(self, stub, name: str, metrics: MuxMetrics) -> None:
        self.name = name
        self.metrics = metrics
        metrics.calls.inc()
        self.call = stub.DecodeMany()
        self.queues: dict[str, asyncio.Queue] = {}
        self.allocs: dict[str, asyncio.Future] = {}
        self.held: dict[str, Hold] = {}  # prefilling elsewhere, KV coming here (``hold``)
        self.allocates: list[decode_pb2.AllocateCall] = []
        self.starts: list[decode_pb2.DecodeStart] = []
        self.cancels: list[str] = []
        self.broken: grpc.aio.AioRpcError | None = None
        self.heard_at = time.monotonic()  # when it last carried anything (opened, a response)
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    def _waiting(self) -> None:
        """A request is about to wait on the call: an idle call's silence starts now."""
        if not self._busy():
            self.heard_at = time.monotonic()

    def _busy(self) -> bool:
        return bool(self.queues or self.allocs or self.held)

    def hold(self, request_id: str) -> Hold:
        """``request_id`` held on this call: its ``lost`` gets the call's status if the call breaks."""
        hold = Hold(self.held, request_id)
        if self.broken is not None:
            hold.lost.set_result(self.broken)
            return hold
        self._waiting()
        self.held[request_id] = hold
        return hold

    def start(self, request: decode_pb2.DecodeRequest, timeout: float | None) -> asyncio.Queue:
        self._waiting()
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.request_id] = queue
        self.starts.append(decode_pb2.DecodeStart(request=request, timeout_ms=_ms(timeout)))
        self._wake.set()
        return queue

    def allocate(self, request: decode_pb2.AllocateRequest, timeout: float | None) -> asyncio.Future:
        self._waiting()
        fut = asyncio.get_running_loop().create_future()
        self.allocs[request.request_id] = fut
        self.allocates.append(decode_pb2.AllocateCall(request=request, timeout_ms=_ms(timeout)))
        self._wake.set()
        return fut

    def leave(self, request_id: str, *, cancel: bool, allocating: bool = False) -> None:
        (self.allocs if allocating else self.queues).pop(request_id, None)
        pending = self.allocates if allocating else self.starts
        unsent = [i for i, p in enumerate(pending) if p.request.request_id == request_id]
        if unsent:  # never sent: drop it rather than send it with a cancel the worker reads first
            del pending[unsent[0]]
            return
        if cancel and self.broken is None:
            self.cancels.append(request_id)
            self._wake.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not (self.starts or self.cancels or self.allocates):
                    continue
                msg = decode_pb2.DecodeManyRequest(starts=self.starts, cancels=self.cancels,
                                                   allocates=self.allocates)
                self.starts, self.cancels, self.allocates = [], [], []
                await self.call.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call is over: the reader reports why
        except Exception:  # never leave the starts unsent with the call open: end it, the reader reports
            log.exception("DecodeMany writer to %s failed", self.name)
            self.call.cancel()

    async def _read(self) -> None:
        err: grpc.aio.AioRpcError
        try:
            async for msg in self.call:
                queues = self.queues
                self.heard_at = time.monotonic()
                self.metrics.messages.inc()
                self.metrics.updates.inc(len(msg.updates) + len(msg.allocated))
                for update in msg.updates:
                    queue = queues.get(update.request_id)
                    if queue is not None:
                        queue.put_nowait(update)
                for result in msg.allocated:
                    fut = self.allocs.pop(result.request_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(result)
            err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.name} ended its stream")
        except grpc.aio.AioRpcError as exc:
            err = _call_status(exc, self.name)
        except asyncio.CancelledError:
            err = rpc_error(grpc.StatusCode.CANCELLED, f"decode stream to {self.name} closed")
        if self.broken is None:  # else abandoned: its requests were told why
            self._fail(err)

    def abandon(self, why: str) -> None:
        """End the call for a worker that stopped answering: every request on it gets UNAVAILABLE."""
        if self.broken is not None:
            return
        self._fail(rpc_error(grpc.StatusCode.UNAVAILABLE,
                             f"decode worker {self.name} stopped answering: {why}"))
        self.call.cancel()
        self._reader.cancel()

    def _fail(self, err: grpc.aio.AioRpcError) -> None:
        self.broken = err
        self._writer.cancel()
        if self._busy():  # they migrate (router/migration.py), are placed again, or fail with its status
            self.metrics.broken.inc()
            log.warning("DecodeMany call to %s ended under %d stream(s), %d Allocate(s) and %d held "
                        "prefill(s): %s %s", self.name, len(self.queues), len(self.allocs), len(self.held),
                        err.code().name, err.details())
        else:
            log.info("DecodeMany call to %s ended: %s %s", self.name, err.code().name, err.details())
        for queue in self.queues.values():
            queue.put_nowait(err)
        for fut in [*self.allocs.values(), *(h.lost for h in self.held.values())]:
            if not fut.done():
                fut.set_result(err)

    def silent_for(self) -> float:
        """Seconds since the call last carried anything, while requests wait on it (0 when none do)."""
        return time.monotonic() - self.heard_at if self._busy() else 0.0

    def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()


def _call_status(exc: grpc.aio.AioRpcError, name: str) -> grpc.aio.AioRpcError:
    """What the requests on a call that failed as a whole get. The call's own status says the call is
    unusable, not that a request was bad: a worker going away (a write racing the drained call's end
    reads INTERNAL "Internal error from Core" in grpc), a connection lost. So UNAVAILABLE: placement
    tries elsewhere, streams migrate. UNIMPLEMENTED (an older worker) and CANCELLED stay as they are."""
    if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
        return exc
    return rpc_error(grpc.StatusCode.UNAVAILABLE,
                     f"DecodeMany call to {name} failed: {exc.code().name}: {exc.details()}")


def _ms(timeout: float | None) -> int:
    return max(1, int(timeout * 1000)) if timeout is not None else 0


def _merged(msgs: list[decode_pb2.DecodeResponse]) -> decode_pb2.DecodeResponse:
    """Consecutive messages of one stream as the one message a Decode call would have sent had they
    been ready together: tokens, logprobs and alternatives in order, the last count and finish."""
    out = decode_pb2.DecodeResponse()
    for m in msgs:
        out.token_ids.extend(m.token_ids)
        out.logprobs.extend(m.logprobs)
        out.top_logprobs.extend(m.top_logprobs)
    out.completion_tokens = msgs[-1].completion_tokens
    out.finish_reason = msgs[-1].finish_reason
    return out


class DecodeStreams:
    """Allocates and Decode streams to one decode worker: on DecodeMany unless off or unsupported."""

    def __init__(self, stub, name: str, *, enabled: bool = True, metrics: MuxMetrics | None = None) -> None:
        self.stub = stub
        self.name = name
        self.enabled = enabled
        self.metrics = metrics if metrics is not None else MuxMetrics()
        self._call: _Call | None = None
        self._holds: dict[str, Hold] = {}  # held without a DecodeMany call (``hold``)

    async def stream(self, request: decode_pb2.DecodeRequest,
                     timeout: float | None) -> AsyncIterator[decode_pb2.DecodeResponse]:
        if not self.enabled:
            async for msg in self._one_call(request, timeout):
                yield msg
            return
        rid = request.request_id
        call = self._open_for(rid, allocating=False)
        queue = call.start(request, timeout)
        # The deadline is one timer for the whole stream that queues an end behind what came before it,
        # not a timeout around every wait (a timer armed and cancelled per token).
        timer = None if timeout is None else asyncio.get_running_loop().call_later(
            timeout, queue.put_nowait, _DEADLINE)
        finished = False
        try:
            while True:
                ready = [await queue.get()]
                while not queue.empty():  # the router fell behind: what is ready goes on as one message
                    ready.append(queue.get_nowait())
                tokens, end = [], None  # the messages up to the first status; a status ends the stream
                for u in ready:
                    if u is _DEADLINE or isinstance(u, grpc.aio.AioRpcError) or u.code:
                        end = u
                        break
                    tokens.append(u.response)
                if tokens:
                    msg = tokens[0] if len(tokens) == 1 else _merged(tokens)
                    finished = bool(msg.finish_reason)  # the worker's stream is over: nothing to cancel
                    yield msg
                    if finished:
                        return
                if end is None:
                    continue
                if end is _DEADLINE:  # the worker still streams it: leaving cancels it there
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                finished = True
                if isinstance(end, grpc.aio.AioRpcError):
                    if end.code() == grpc.StatusCode.UNIMPLEMENTED:
                        break  # an older worker: one Decode call per request from now on
                    raise end
                raise _status_error(end.code, end.message)
        finally:
            if timer is not None:
                timer.cancel()
            call.leave(rid, cancel=not finished)
        self._unsupported()
        async for msg in self._one_call(request, timeout):
            yield msg

    async def allocate(self, request: decode_pb2.AllocateRequest,
                       timeout: float | None) -> decode_pb2.AllocateResponse:
        """What an Allocate call would answer, or raise: on the DecodeMany call unless off or unsupported."""
        if not self.enabled:
            return await self.stub.Allocate(request, timeout=timeout)
        rid = request.request_id
        call = self._open_for(rid, allocating=True)
        fut = call.allocate(request, timeout)
        answered = False
        try:
            async with asyncio.timeout(timeout):
                result = await fut
            answered = True
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            # not answered (deadline, cancelled): the worker cancels the Allocate, which frees what it
            # reserved; the pipeline's Release covers an answer already on its way
            call.leave(rid, cancel=not answered, allocating=True)
        if isinstance(result, grpc.aio.AioRpcError):
            if result.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise result
            self._unsupported()
            return await self.stub.Allocate(request, timeout=timeout)
        if result.code:
            raise _status_error(result.code, result.message)
        return result.response

    def hold(self, request_id: str) -> Hold:
        """Mark ``request_id`` as waiting on this worker while its prefill runs elsewhere (its Allocate
        was answered); ``Hold.lost`` resolves with an UNAVAILABLE status if the worker is lost meanwhile:
        its DecodeMany call breaks or is given up, or, without a call (``--decode-mux off``, an older
        worker), the worker fails a health poll while the hold is ``UNRESPONSIVE_S`` old
        (``unresponsive``): a dead receiver would be found by the push itself, a frozen one only by the
        push's stall timeout."""
        call = self._call
        if self.enabled and call is not None:
            return call.hold(request_id)
        hold = self._holds[request_id] = Hold(self._holds, request_id)
        return hold

    def _unsupported(self) -> None:
        """The worker answered DecodeMany with UNIMPLEMENTED (an older build): calls from now on."""
        log.warning("decode worker %s has no DecodeMany: one call per Allocate and stream", self.name)
        self.enabled = False

    def _open_for(self, rid: str, *, allocating: bool) -> _Call:
        """The open call (a new one if none is, or the last broke), refusing an id already on it."""
        call = self._call
        if call is None or call.broken is not None:
            call = self._call = _Call(self.stub, self.name, self.metrics)
        if rid in (call.allocs if allocating else call.queues):
            what = "allocating" if allocating else "streaming"
            raise rpc_error(grpc.StatusCode.ALREADY_EXISTS,
                            f"request {rid!r} is already {what} on {self.name}")
        return call

    async def _one_call(self, request: decode_pb2.DecodeRequest,
                        timeout: float | None) -> AsyncIterator[decode_pb2.DecodeResponse]:
        call = self.stub.Decode(request, timeout=timeout)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    def unresponsive(self, why: str) -> bool:
        """The worker failed a health poll: give up the open call if requests wait on it and it has
        carried nothing for ``UNRESPONSIVE_S`` (its requests get UNAVAILABLE, so streams migrate and
        Allocates are placed again). A worker merely slow to answer a poll while its streams flow
        keeps them. Holds without a call that are ``UNRESPONSIVE_S`` old are given up too. True when
        anything was given up."""
        now = time.monotonic()
        stale = [h for h in self._holds.values() if now - h.since >= UNRESPONSIVE_S]
        for h in stale:
            h.release()
            if not h.lost.done():
                h.lost.set_result(rpc_error(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.name} stopped "
                                            f"answering ({why}) with a prefill pushing here for "
                                            f"{now - h.since:.1f}s"))
        if stale:
            log.warning("decode worker %s failed its health poll (%s): %d prefill(s) pushing here for %.1fs "
                        "or more are given up", self.name, why, len(stale), UNRESPONSIVE_S)
            self.metrics.abandoned.inc()
        return self._give_up_call(why) or bool(stale)

    def _give_up_call(self, why: str) -> bool:
        call = self._call
        if call is None or call.broken is not None:
            return False
        silent = call.silent_for()
        if silent < UNRESPONSIVE_S:
            return False
        log.warning("DecodeMany call to %s: %d stream(s), %d Allocate(s) and %d prefill(s) pushing here "
                    "heard nothing for %.1fs and the worker failed its health poll (%s): giving the call up",
                    self.name, len(call.queues), len(call.allocs), len(call.held), silent, why)
        self.metrics.abandoned.inc()
        call.abandon(f"{why}; nothing on its DecodeMany call for {silent:.1f}s")
        return True

    def close(self) -> None:
        if self._call is not None:
            self._call.close()
            self._call = None
