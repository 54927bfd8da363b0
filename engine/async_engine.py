"""An asyncio-facing driver for the single-threaded ``LLMEngine``.

The engine is not thread-safe and its ``step()`` is long (a forward pass), so exactly one thread
— the *engine thread* — ever touches it. Lifecycle:

* ``AsyncEngine(engine)`` then ``start()`` spawns the engine thread. asyncio code never calls the
  engine directly: ``call(fn)`` ships a closure to the engine thread and awaits its result.
* The engine thread loops: run every queued closure; if the engine has unfinished work, ``step()``
  and route each ``StepOutput`` to the ``RequestStream`` of its request (through
  ``loop.call_soon_threadsafe``); otherwise run one piece of the engine's deferred start-up work
  (``idle_work``: a CUDA graph), if any, or block on the command queue — no busy spin when idle.
* ``generate()`` / ``prefill()`` / ``commit_prefilled()`` register a stream *before* the request
  enters the engine (in the same closure), so no output can be lost. A stream ends on an output with
  ``finished=True``. When the consumer goes away early (task cancelled, generator closed), the
  request is aborted on the engine thread so its blocks go back.
* ``stop()`` aborts everything still running, ends all streams and joins the thread.

``snapshot`` is refreshed by the engine thread after every step/command, so stats readers (GetStats)
never wait behind a forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class EngineSnapshot:
    free_blocks: int = 0
    total_blocks: int = 0
    num_running: int = 0
    queue_depth: int = 0
    num_streams: int = 0


class EngineStopped(RuntimeError):
    """The engine thread is gone (stopped or crashed); no more requests are served."""


class RequestStream:
    """Outputs of one request, in order; async-iterable until the finishing output."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def put_threadsafe(self, item: Any) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def put_nowait(self, item: Any) -> None:
        """On the loop's thread (``_deliver`` hands a whole step's outputs over in one wake-up)."""
        self._queue.put_nowait(item)

    async def get(self) -> Any:
        item = await self._queue.get()
        return self._check(item)

    async def get_ready(self) -> list[Any]:
        """The next output and every one already queued behind it (up to the finishing one): a slow
        consumer catches up in one message instead of one per token."""
        items = [self._check(await self._queue.get())]
        while not self.finished and not self._queue.empty():
            items.append(self._check(self._queue.get_nowait()))
        return items

    def _check(self, item: Any) -> Any:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if getattr(item, "finished", False):
            self.finished = True
        return item


class AsyncEngine:
    def __init__(self, engine: Any, *, name: str = "engine", idle_work: bool = True) -> None:
        """``idle_work=False``: no deferred start-up work (``engine.idle_work``: CUDA graph captures) until
        ``allow_idle_work()``. A worker holds it back while it sets up its KV plane: a capture is
        invalidated by any context-wide CUDA call another thread makes meanwhile (UCX opening its CUDA
        memory domain calls ``cuCtxSetFlags``; measured: the capture failed, the engine thread died)."""
        self.engine = engine
        self._name = name
        self._idle_allowed = idle_work
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._compiling: dict[tuple, asyncio.Future] = {}  # constraint key -> compilation (engine.grammar)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._refresh()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def allow_idle_work(self) -> None:
        """Start the deferred start-up work held back by ``idle_work=False`` (once the engine is idle)."""
        if not self._idle_allowed:
            self._idle_allowed = True
            self._commands.put(_noop)  # wake a thread waiting for commands

    @property
    def alive(self) -> bool:
        return self._thread is not None and not self._stopped.is_set()

    # ---- calls onto the engine thread ---------------------------------------------------------------
    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise its exception)."""
        return await self.post(fn)

    def post(self, fn: Callable[[Any], T]) -> asyncio.Future[T]:
        """Queue ``fn(engine)`` for the engine thread now; the returned future settles when it ran.

        Commands run between forward passes, so a busy engine runs this one after its current step.
        ``call`` awaits that; a caller that need not wait (a release whose answer nobody reads) keeps
        the future and goes on. Commands run in the order they were posted."""
        if self._stopped.is_set() or self._loop is None:
            raise EngineStopped(f"engine is not running: {self.error or 'stopped'}")
        fut: asyncio.Future[T] = self._loop.create_future()
        loop = self._loop

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed back to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return fut

    async def _open(self, request_id: str, add: Callable[[Any], Any]) -> tuple[RequestStream, Any]:
        """Register a stream for ``request_id`` and run ``add`` in the same engine-thread closure."""
        assert self._loop is not None
        stream = RequestStream(self._loop)

        def register(engine: Any) -> Any:
            self._streams[request_id] = stream
            try:
                return add(engine)
            except BaseException:
                self._streams.pop(request_id, None)
                raise

        result = await self.call(register)
        return stream, result

    async def _iterate(self, request_id: str, stream: RequestStream) -> AsyncIterator[Any]:
        try:
            while not stream.finished:
                yield await stream.get()
        finally:
            if not stream.finished:
                await self._abort_quietly(request_id)

    async def _iterate_ready(self, request_id: str, stream: RequestStream) -> AsyncIterator[list[Any]]:
        try:
            while not stream.finished:
                yield await stream.get_ready()
        finally:
            if not stream.finished:
                await self._abort_quietly(request_id)

    async def _abort_quietly(self, request_id: str) -> None:
        def abort(engine: Any) -> None:
            self._streams.pop(request_id, None)
            engine.abort(request_id)

        try:
            await asyncio.shield(self.call(abort))
        except Exception:  # the request may already be gone; abort is best effort
            log.debug("abort of %s failed", request_id, exc_info=True)

    async def compile_constraint(self, params: Any) -> None:
        """Compile ``params``' structured-output constraint, if any, on a thread of its own (neither the
        event loop nor the engine thread waits for it), so the engine finds it cached. GrammarError
        (INVALID_ARGUMENT) when it cannot be compiled or takes longer than
        ``PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S``; a compilation that timed out goes on (llguidance's limits
        bound it) and a request with the same constraint waits for that one instead of starting another."""
        constraint = getattr(params, "constraint", None)
        grammars = getattr(self.engine, "grammars", None)
        if constraint is None or grammars is None or grammars.cached(constraint):
            return
        from engine.grammar.spec import GrammarError
        from pdserve.settings import grammar_compile_timeout_s

        key = constraint.key
        fut = self._compiling.get(key)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(grammars.compile, constraint))
            self._compiling[key] = fut
            fut.add_done_callback(lambda _f: self._compiling.pop(key, None))
        timeout = grammar_compile_timeout_s()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise GrammarError(f"the {constraint.kind} constraint did not compile within {timeout:g} s"
                               ) from None

    # ---- request-level API ----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """Full generation in this engine (colocated role / reference). Yields StepOutputs."""
        await self.compile_constraint(params)
        stream, _ = await self._open(request_id, lambda e: e.add_request(request_id, prompt_ids, params))
        async for out in self._iterate(request_id, stream):
            yield out

    async def prefill(self, request_id: str, prompt_ids: list[int], params: Any, *, layer_sink: Any = None,
                      release_on_error: bool = True) -> tuple[Any, list[int]]:
        """Run the prompt; returns (the "prefilled" StepOutput, the request's block table).

        The blocks stay pinned until ``release(request_id)``; if this coroutine is cancelled or the
        prompt did not complete, the request is aborted and released -- unless
        ``release_on_error=False``: then the caller always releases (a layer-wise KV sender must stop
        reading the blocks first). ``layer_sink``: see
        ``engine.layer_sink`` (its methods run on the engine thread).
        """
        kw = {"layer_sink": layer_sink} if layer_sink is not None else {}
        await self.compile_constraint(params)
        stream, _ = await self._open(request_id,
                                     lambda e: e.add_prefill_request(request_id, prompt_ids, params, **kw))
        try:
            out = await stream.get()
            if out.finish_reason != "prefilled":
                if release_on_error:
                    await self.release(request_id)
                return out, []
            table = getattr(out, "block_ids", None)
            if table is None:  # an engine whose outputs do not carry the table
                table = await self.call(lambda e: list(e.block_table(request_id)))
            return out, list(table)
        except BaseException:
            if release_on_error:
                await asyncio.shield(self.release(request_id))
            raise

    async def reserve(self, request_id: str, prompt_ids: list[int], params: Any) -> Any:
        await self.compile_constraint(params)
        return await self.call(lambda e: e.reserve(request_id, prompt_ids, params))

    async def commit_prefilled(self, request_id: str, first_token_id: int) -> AsyncIterator[Any]:
        """Join the decode batch with ``first_token_id``; yields the StepOutputs that follow."""
        stream, _ = await self._open(request_id,
                                     lambda e: e.commit_prefilled(request_id, first_token_id))
        async for out in self._iterate(request_id, stream):
            yield out

    async def commit_prefilled_ready(self, request_id: str, first_token_id: int) -> AsyncIterator[list[Any]]:
        """``commit_prefilled``, yielding every StepOutput that is ready at once as one list."""
        stream, _ = await self._open(request_id,
                                     lambda e: e.commit_prefilled(request_id, first_token_id))
        async for outs in self._iterate_ready(request_id, stream):
            yield outs

    async def generate_ready(self, request_id: str, prompt_ids: list[int],
                             params: Any) -> AsyncIterator[list[Any]]:
        """``generate``, yielding every StepOutput that is ready at once as one list."""
        await self.compile_constraint(params)
        stream, _ = await self._open(request_id, lambda e: e.add_request(request_id, prompt_ids, params))
        async for outs in self._iterate_ready(request_id, stream):
            yield outs

    async def release(self, request_id: str) -> None:
        await self.release_soon(request_id)

    def release_soon(self, request_id: str) -> asyncio.Future[None]:
        """Queue the release of ``request_id`` (its blocks back to the pool) without waiting for it:
        on a busy engine it runs after the forward pass in flight. A request id used again later is
        queued behind this release, so it never sees the old request's state."""
        def release(engine: Any) -> None:
            self._streams.pop(request_id, None)
            engine.release(request_id)

        return self.post(release)

    async def abort(self, request_id: str) -> None:
        await self._abort_quietly(request_id)

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            idle_ok = True  # False after idle work that could do nothing, until the next command
            while True:
                engine_busy = self.engine.has_unfinished()
                idle = not engine_busy and idle_ok and self._has_idle_work()
                try:
                    cmd = self._commands.get_nowait() if engine_busy or idle else self._commands.get()
                except queue.Empty:
                    cmd = ...
                if cmd is None:
                    break
                if cmd is ... and not engine_busy:  # nothing to step or run: deferred start-up work
                    idle_ok = self.engine.idle_work()
                    continue
                idle_ok = True
                if cmd is not ...:
                    cmd()
                    # run every command queued so far before stepping (batch admissions together)
                    while True:
                        try:
                            nxt = self._commands.get_nowait()
                        except queue.Empty:
                            break
                        if nxt is None:
                            return
                        nxt()
                    self._refresh()
                    continue
                ready = []
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    ready.append((stream, out))
                if ready:  # one loop wake-up per step, not one per request
                    self._loop.call_soon_threadsafe(_deliver, ready)
                self._refresh()
        except BaseException as exc:  # a crashed engine must fail every waiter, not hang them
            log.exception("engine thread crashed")
            self.error = exc
        finally:
            self._stopped.set()
            self._shutdown_streams()

    def _has_idle_work(self) -> bool:
        has = getattr(self.engine, "has_idle_work", None)  # engines without idle work (fakes) have none
        return bool(self._idle_allowed and has is not None and has())

    def _shutdown_streams(self) -> None:
        err = EngineStopped(f"engine stopped: {self.error or 'shutdown'}")
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            stream.put_threadsafe(err)
        self._streams.clear()
        sync = getattr(self.engine, "sync", None)  # a step launched ahead gives its blocks back
        if sync is not None and self.error is None:
            try:
                sync()
            except Exception:
                log.debug("reading the step in flight at shutdown failed", exc_info=True)
        # fail any call() still queued
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd is not None:
                try:
                    cmd()
                except BaseException:
                    pass
        self._refresh()

    def _refresh(self) -> None:
        e = self.engine
        self.snapshot = EngineSnapshot(
            free_blocks=int(getattr(e, "num_free_blocks", 0)),
            total_blocks=int(getattr(e, "num_total_blocks", 0)),
            num_running=int(_maybe_call(getattr(e, "num_running", None), len(self._streams))),
            queue_depth=int(_maybe_call(getattr(e, "num_waiting", None), 0)),
            num_streams=len(self._streams),
        )


def _maybe_call(value: Any, default: int) -> int:
    if value is None:
        return default
    return value() if callable(value) else value


def _deliver(ready: list[tuple[RequestStream, Any]]) -> None:
    for stream, out in ready:
        stream.put_nowait(out)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _noop() -> None:
    """A command that only wakes the engine thread (``allow_idle_work``)."""
