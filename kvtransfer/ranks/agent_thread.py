"""A ``RankAgent`` on an event loop of its own thread, driven from the worker's loop.

Why it exists: a decode worker's event loop also runs every token stream (and gRPC's callbacks for
them), and the KV plane's turns on it (a TCP frame's hand-off to a receive thread, a NIXL notification
poll, an expectation's completion) wait behind those. On a loop of its own the KV plane turns as soon
as the GIL lets it. Tensor-parallel follower ranks run their agents this way (pdserve/app/tp_ranks.py);
``--kv-own-loop on`` gives rank 0 the same, in process. Measured on 2x H200 it did not pay: the idle
time before each TCP frame stayed ~8 ms and the wait after a prefill grew (a third thread running
Python contends for the GIL with the engine's and the gRPC loop's), so it is off by default
(docs/kvtransfer.md, "An event loop of its own").

``ThreadedAgent`` offers what ``RankedLink`` uses of a local agent: the same coroutine methods (each runs
on the agent's loop; cancelling the caller cancels it there), ``release`` and ``stats`` as coroutines,
and the agent's read-only attributes. Calls keep their order: each is handed to the agent's loop with
``call_soon_threadsafe`` in the order made, so a cancellation followed by an abort arrive in that order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("kvtransfer.ranks")


class AgentThread:
    """An event loop running in a daemon thread of its own until ``stop``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, coro: Awaitable[Any]) -> asyncio.Future:
        """Run ``coro`` on this thread's loop; the returned future is the caller's loop's."""
        if not self._started:
            self._thread.start()
            self._started = True
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def stop(self) -> None:
        if not self._started:
            self.loop.close()
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, 30)


def own_copy_stream(device: Any) -> None:
    """On a KV agent's own thread (a TP follower's, or rank 0's with ``--kv-own-loop``): this thread's
    device, and a stream of its own, so the agent's copies never queue behind the forward's stream."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class ThreadedAgent:
    """A started ``RankAgent`` living on ``thread``'s loop; see the module docstring."""

    def __init__(self, agent: Any, thread: AgentThread,
                 closers: list[Callable[[], Awaitable[Any]]] = ()) -> None:
        self.agent = agent
        self.thread = thread
        self._closers = list(closers)  # coroutines run on the agent's loop before the agent closes

    @classmethod
    async def start(cls, setup: Callable[[], Awaitable[tuple[Any, list]]],
                    name: str = "kv-loop") -> ThreadedAgent:
        """``setup()`` runs on the new loop: it makes and starts the agent (and whatever else serves it
        there) and returns (agent, closers)."""
        thread = AgentThread(name)
        try:
            agent, closers = await thread.submit(setup())
        except BaseException:
            await thread.stop()
            raise
        return cls(agent, thread, closers)

    # -- the agent's read-only attributes ------------------------------------------------------------
    @property
    def backends(self) -> list[str]:
        return self.agent.backends

    @property
    def shape(self):
        return self.agent.shape

    @property
    def cache(self):
        return self.agent.cache

    @property
    def cache_tx(self):
        return self.agent.cache_tx

    def endpoints(self) -> tuple[dict, dict | None]:
        return self.agent.endpoints()

    # -- calls, each on the agent's loop ---------------------------------------------------------------
    def _on_loop(self, coro: Awaitable[Any]) -> asyncio.Future:
        return self.thread.submit(coro)

    async def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        return await self._on_loop(self.agent.expect(request_id, block_ids, timeout_s))

    async def wait_received(self, request_id: str, timeout_s: float | None = None) -> dict:
        return await self._on_loop(self.agent.wait_received(request_id, timeout_s))

    async def release(self, request_id: str) -> None:
        return await self._on_loop(_call(self.agent.release, request_id))

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        return await self._on_loop(self.agent.abort(request_id, reason))

    async def send(self, request_id: str, src: list[int], orders: list, *, streamed: bool,
                   timeout_s: float) -> None:
        return await self._on_loop(self.agent.send(request_id, src, orders, streamed=streamed,
                                                   timeout_s=timeout_s))

    async def push(self, request_id: str, layers: list[int], final: bool) -> None:
        return await self._on_loop(self.agent.push(request_id, layers, final))

    async def wait_sent(self, request_id: str, timeout_s: float | None = None) -> dict:
        return await self._on_loop(self.agent.wait_sent(request_id, timeout_s))

    async def close_send(self, request_id: str, reason: str = "closed") -> None:
        return await self._on_loop(self.agent.close_send(request_id, reason))

    async def stats(self) -> dict[str, int]:
        return await self._on_loop(_call(self.agent.stats))

    async def close(self) -> None:
        async def teardown() -> None:
            for closer in self._closers:
                try:
                    await closer()
                except Exception:  # noqa: BLE001 - closing must reach the agent
                    log.warning("kvtransfer: closing beside the KV loop failed", exc_info=True)
            await self.agent.close()

        try:
            await self._on_loop(teardown())
        finally:
            await self.thread.stop()
