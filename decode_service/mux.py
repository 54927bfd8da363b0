"""One DecodeMany call: the Allocates and Decode streams of many requests on one long-lived gRPC call.

A router keeps one such call open per decode worker (``router/decode_mux.py``). Per request it sends
an ``AllocateCall`` (the ``AllocateRequest`` an Allocate call takes) and later a ``DecodeStart``
(the ``DecodeRequest`` a Decode call takes), each with what is left of the request's deadline; the
worker answers with an ``AllocateResult`` (the answer, or the status the Allocate call would have
ended with) and ``DecodeUpdate``s: the messages that request's Decode call would have carried, and,
for a stream that fails, its status. Every response carries all the results and updates that were
ready when the writer woke, for every request: one engine step's tokens for N streams go out as one
message instead of N, and a request costs no call of its own.

Lifecycle of the call::

    reader    allocates -> one task per request: ``allocate(request)`` under its deadline, its answer
                           or status to the outbox
              starts    -> one task per request: ``responses(request)`` under its deadline, each
                           message to the outbox; a failure appends the mapped status
              cancels   -> that request's task is cancelled (an Allocate's frees what it reserved, a
                           stream's ``finally`` frees the request, as a cancelled call's would);
                           nothing more is sent for it
    writer    wakes when the outbox has something; sends it all as one response
    drain     (the server's SIGTERM) new Allocates are refused with UNAVAILABLE at once, and so are
              streams of requests this call did not allocate. A request allocated here before the
              drain still holds its lease (its prefill may be pushing KV right now), so its stream is
              admitted and served: it is not prefilled a second time elsewhere. The call ends once
              nothing runs and no lease it made is left (started, released or expired), so the
              server's grace is not waited out
    end       the router half-closes: what runs finishes, then the call ends. The call is cancelled
              or broken: every task is cancelled, so every request is freed

Nothing is shared between two calls, and a request id already allocating or streaming on this call
is refused (ALREADY_EXISTS) rather than run twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from pdserve.server import status_for
from pdserve.v1 import decode_pb2

log = logging.getLogger(__name__)
MAX_UPDATES_PER_MESSAGE = 512  # far under the message size limit even with top logprobs on every token

Responses = Callable[[decode_pb2.DecodeRequest], AsyncIterator[decode_pb2.DecodeResponse]]
Allocate = Callable[[decode_pb2.AllocateRequest], Awaitable[decode_pb2.AllocateResponse]]
Leased = Callable[[str], bool]  # does the worker still hold this request's lease?
DRAIN_POLL_S = 0.2  # while draining, how often the call looks whether its leases are gone
# (request id, message or None, status code, status message): built into one response per write
_Entry = tuple[str, object, int, str]


class DecodeManySession:
    def __init__(self, responses: Responses, allocate: Allocate, draining: asyncio.Event,
                 leased: Leased | None = None) -> None:
        self._responses = responses
        self._allocate = allocate
        self._draining = draining
        self._leased = leased if leased is not None else (lambda rid: False)
        self._leases: set[str] = set()  # allocated on this call, stream not started yet
        self._prune_at = 64  # leases released or expired without a start are dropped past this many
        self._streams: dict[str, asyncio.Task] = {}
        self._allocs: dict[str, asyncio.Task] = {}
        self._updates: list[_Entry] = []
        self._allocated: list[_Entry] = []
        self._wake = asyncio.Event()
        self._reading = True

    @property
    def busy(self) -> bool:
        return bool(self._streams or self._allocs)

    async def serve(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(request_iterator))
        drain = loop.create_task(self._on_drain())
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._updates or self._allocated:
                    updates = self._updates[:MAX_UPDATES_PER_MESSAGE]
                    del self._updates[:MAX_UPDATES_PER_MESSAGE]
                    allocated = self._allocated[:]  # in place: tasks hold these lists
                    self._allocated.clear()
                    await context.write(_response(updates, allocated))
                if not self.busy and (not self._reading or (self._draining.is_set() and not self._waiting())):
                    return
        finally:
            reader.cancel()
            drain.cancel()
            tasks = [*self._streams.values(), *self._allocs.values()]
            for task in tasks:
                task.cancel()
            # each task frees its request on the worker as it ends; wait for them all
            await asyncio.gather(reader, drain, *tasks, return_exceptions=True)

    async def _read(self, request_iterator) -> None:
        try:
            async for msg in request_iterator:
                for rid in msg.cancels:
                    self._leases.discard(rid)
                    for tasks in (self._allocs, self._streams):
                        task = tasks.get(rid)
                        if task is not None:
                            task.cancel()
                for call in msg.allocates:
                    self._begin(self._allocs, self._allocated, call.request.request_id, call.timeout_ms,
                                lambda r=call.request: self._allocation(r))
                for start in msg.starts:
                    rid = start.request.request_id
                    leased_here = rid in self._leases
                    self._leases.discard(rid)
                    self._begin(self._streams, self._updates, rid, start.timeout_ms,
                                lambda r=start.request: self._stream(r), admit_draining=leased_here)
        finally:
            self._reading = False
            self._wake.set()

    def _begin(self, tasks: dict[str, asyncio.Task], out: list[_Entry], rid: str, timeout_ms: int,
               body: Callable[[], Awaitable[None]], admit_draining: bool = False) -> None:
        if self._draining.is_set() and not admit_draining:
            self._fail(out, rid, grpc.StatusCode.UNAVAILABLE, "decode worker is draining: no new requests")
        elif not rid:
            self._fail(out, rid, grpc.StatusCode.INVALID_ARGUMENT, "a request_id is required")
        elif rid in tasks:
            self._fail(out, rid, grpc.StatusCode.ALREADY_EXISTS,
                       f"request {rid!r} is already running on this call")
        else:
            timeout = timeout_ms / 1000.0 if timeout_ms > 0 else None
            tasks[rid] = asyncio.get_running_loop().create_task(self._guard(tasks, out, rid, timeout, body))

    async def _guard(self, tasks: dict[str, asyncio.Task], out: list[_Entry], rid: str, timeout: float | None,
                     body: Callable[[], Awaitable[None]]) -> None:
        """``body`` under the deadline; a failure becomes the status its own call would have ended with."""
        try:
            async with asyncio.timeout(timeout):
                await body()
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # cancelled by the router (or the call ending)
                raise
            self._fail(out, rid, grpc.StatusCode.CANCELLED, "cancelled on the decode worker")
        except TimeoutError:
            self._fail(out, rid, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except Exception as exc:
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.error("internal error in request %s on DecodeMany: %s", rid, message, exc_info=exc)
            self._fail(out, rid, code, message)
        finally:
            tasks.pop(rid, None)
            self._wake.set()

    async def _allocation(self, request: decode_pb2.AllocateRequest) -> None:
        answer = await self._allocate(request)
        self._leases.add(request.request_id)
        if len(self._leases) > self._prune_at:  # amortised: a long-lived call never piles up old ids
            self._waiting()
            self._prune_at = 2 * len(self._leases) + 64
        self._allocated.append((request.request_id, answer, 0, ""))
        self._wake.set()

    async def _stream(self, request: decode_pb2.DecodeRequest) -> None:
        rid = request.request_id
        async for msg in self._responses(request):
            self._updates.append((rid, msg, 0, ""))
            self._wake.set()

    def _fail(self, out: list[_Entry], rid: str, code: grpc.StatusCode, message: str) -> None:
        out.append((rid, None, code.value[0], message))
        self._wake.set()

    def _waiting(self) -> bool:
        """Whether a lease made on this call may still see its stream start (drain keeps the call open)."""
        self._leases = {rid for rid in self._leases if self._leased(rid)}
        return bool(self._leases)

    async def _on_drain(self) -> None:
        await self._draining.wait()
        while True:  # a lease that is released or expires sends nothing: look again now and then
            self._wake.set()
            await asyncio.sleep(DRAIN_POLL_S)


def _response(updates: list[_Entry], allocated: list[_Entry]) -> decode_pb2.DecodeManyResponse:
    out = decode_pb2.DecodeManyResponse()
    for entries, add in ((updates, out.updates.add), (allocated, out.allocated.add)):
        for rid, msg, code, message in entries:
            if msg is not None:
                add(request_id=rid).response.CopyFrom(msg)  # the one copy of the message
            else:
                add(request_id=rid, code=code, message=message)
    return out
