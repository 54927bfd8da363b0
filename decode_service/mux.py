"""One DecodeMany call: the Decode streams of many requests multiplexed on one long-lived gRPC call.

A router keeps one such call open per decode worker (``router/decode_mux.py``). Per request it
sends a ``DecodeStart`` (the same ``DecodeRequest`` a Decode call takes, and what is left of the
request's deadline); the worker answers with ``DecodeUpdate``s: the messages that request's Decode
call would have carried, and, for a stream that fails, the status that call would have ended with.
Every response carries all the updates that were ready when the writer woke, for every request: one
engine step's tokens for N streams go out as one message instead of N, and a request costs no call
of its own.

Lifecycle of the call::

    reader    starts  -> one task per request: ``responses(request)`` under its deadline, each
                         message appended to the outbox; a failure appends the mapped status
              cancels -> that request's task is cancelled (its ``finally`` frees the request, as a
                         cancelled Decode call's does); nothing more is sent for it
    writer    wakes when the outbox has updates; sends them all as one response
    drain     (the server's SIGTERM) new starts are refused with UNAVAILABLE at once; the call ends
              once the streams it carries are done, so the server's grace period is not waited out
    end       the router half-closes: the running streams finish, then the call ends. The call is
              cancelled or broken: every task is cancelled, so every request is freed

Nothing is shared between two calls, and a request id already running on this call is refused
(ALREADY_EXISTS) rather than run twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.server import status_for
from pdserve.v1 import decode_pb2

log = logging.getLogger(__name__)
MAX_UPDATES_PER_MESSAGE = 512  # far under the message size limit even with top logprobs on every token

Responses = Callable[[decode_pb2.DecodeRequest], AsyncIterator[decode_pb2.DecodeResponse]]


class DecodeManySession:
    def __init__(self, responses: Responses, draining: asyncio.Event) -> None:
        self._responses = responses
        self._draining = draining
        self._tasks: dict[str, asyncio.Task] = {}
        # (request id, message or None, status code, status message): built into one response per write
        self._outbox: list[_Update] = []
        self._wake = asyncio.Event()
        self._reading = True

    async def serve(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator))
        drain = asyncio.get_running_loop().create_task(self._on_drain())
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._outbox:
                    batch = self._outbox[:MAX_UPDATES_PER_MESSAGE]
                    del self._outbox[:MAX_UPDATES_PER_MESSAGE]
                    await context.write(_response(batch))
                if not self._tasks and (not self._reading or self._draining.is_set()):
                    return
        finally:
            reader.cancel()
            drain.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            # each task's finally frees its request on the worker; wait for them all
            await asyncio.gather(reader, drain, *tasks, return_exceptions=True)

    async def _read(self, request_iterator) -> None:
        try:
            async for msg in request_iterator:
                for rid in msg.cancels:
                    task = self._tasks.get(rid)
                    if task is not None:
                        task.cancel()
                for start in msg.starts:
                    self._start(start)
        finally:
            self._reading = False
            self._wake.set()

    def _start(self, start: decode_pb2.DecodeStart) -> None:
        rid = start.request.request_id
        if self._draining.is_set():
            self._fail(rid, grpc.StatusCode.UNAVAILABLE, "decode worker is draining: no new streams")
        elif not rid:
            self._fail(rid, grpc.StatusCode.INVALID_ARGUMENT, "DecodeStart needs a request_id")
        elif rid in self._tasks:
            self._fail(rid, grpc.StatusCode.ALREADY_EXISTS,
                       f"request {rid!r} is already streaming on this call")
        else:
            timeout = start.timeout_ms / 1000.0 if start.timeout_ms > 0 else None
            task = asyncio.get_running_loop().create_task(self._stream(start.request, timeout))
            self._tasks[rid] = task

    async def _stream(self, request: decode_pb2.DecodeRequest, timeout: float | None) -> None:
        rid = request.request_id
        try:
            async with asyncio.timeout(timeout):
                async for msg in self._responses(request):
                    self._outbox.append((rid, msg, 0, ""))
                    self._wake.set()
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # cancelled by the router (or the call ending)
                raise
            self._fail(rid, grpc.StatusCode.CANCELLED, "decode stream cancelled on the worker")
        except TimeoutError:
            self._fail(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except Exception as exc:
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.error("internal error in the decode stream of %s: %s", rid, message, exc_info=exc)
            self._fail(rid, code, message)
        finally:
            self._tasks.pop(rid, None)
            self._wake.set()

    def _fail(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        self._outbox.append((rid, None, code.value[0], message))
        self._wake.set()

    async def _on_drain(self) -> None:
        await self._draining.wait()
        self._wake.set()



_Update = tuple[str, decode_pb2.DecodeResponse | None, int, str]


def _response(batch: list[_Update]) -> decode_pb2.DecodeManyResponse:
    out = decode_pb2.DecodeManyResponse()
    add = out.updates.add
    for rid, msg, code, message in batch:
        if msg is not None:
            add(request_id=rid).response.CopyFrom(msg)  # the one copy of the message
        else:
            add(request_id=rid, code=code, message=message)
    return out
