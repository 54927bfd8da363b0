"""A bounded, FIFO, router-side queue for decode Allocates that found no free KV blocks.

A decode worker answers ``Allocate`` with RESOURCE_EXHAUSTED when it cannot reserve the prompt's
blocks. Past the knee that is normal and transient: every request it is decoding frees its blocks
within seconds. Failing the request there turns a short wait into an error the client must retry
blind, so the router holds it instead, per decode worker, first come first served:

    call(worker, attempt, timeout)
      nobody waiting for that worker      try at once; anything but RESOURCE_EXHAUSTED is the answer
      full (``max_waiters`` waiting)      QueueRefused("... queue full"), at once
      else join the tail                  wait; only the head retries, when ``wake(worker)`` says
                                          blocks were freed (a request on it ended), or after a
                                          backoff (``poll_s``, doubling to ``max_poll_s``: other
                                          routers' requests and expiring leases free blocks too)
      the head's Allocate succeeds        it leaves, the next head retries at once (blocks may remain)
      ``min(timeout, max_wait_s)`` over   QueueRefused("... no free blocks after N s")

Whatever way a waiter leaves (answer, refusal, error, cancellation: the client went away), it is
taken out of the queue in a ``finally`` and the next head is woken, so nothing waits on a departed
request and ``waiting()`` is 0 when idle. ``expected_wait_s(worker)`` (for admission control) is the
number of waiters ahead times the recent interval between successful dequeues on that worker.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

T = TypeVar("T")


class QueueRefused(Exception):
    """The Allocate cannot be served in time: the queue is full, or no blocks came free in time."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full" | "no_blocks"
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class _Waiter:
    since: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)


def _exhausted(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


class AllocateQueue:
    def __init__(self, *, max_waiters: int = 64, max_wait_s: float = 10.0, poll_s: float = 0.05,
                 max_poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[str, float], None] | None = None) -> None:
        if max_waiters < 0 or max_wait_s < 0 or not 0 < poll_s <= max_poll_s:
            raise ValueError(f"need max_waiters >= 0, max_wait_s >= 0 and 0 < poll_s <= max_poll_s, got "
                             f"{max_waiters}, {max_wait_s}, {poll_s}, {max_poll_s}")
        self.max_waiters = max_waiters
        self.max_wait_s = max_wait_s
        self.poll_s = poll_s
        self.max_poll_s = max_poll_s
        self.clock = clock
        self.on_wait = on_wait  # (outcome, seconds waited) of every waiter that leaves
        self._queues: dict[str, deque[_Waiter]] = {}
        self._interval: dict[str, float] = {}   # worker -> EWMA seconds between successful dequeues
        self._last_out: dict[str, float] = {}

    def waiting(self, worker_id: str | None = None) -> int:
        if worker_id is not None:
            return len(self._queues.get(worker_id, ()))
        return sum(len(q) for q in self._queues.values())

    def expected_wait_s(self, worker_id: str) -> float:
        """Seconds a newcomer would wait for blocks on ``worker_id`` (0 with nobody waiting)."""
        n = self.waiting(worker_id)
        return (n + 1) * self._interval.get(worker_id, 0.0) if n else 0.0

    def wake(self, worker_id: str) -> None:
        """Blocks were (probably) freed on ``worker_id``: its head retries now."""
        q = self._queues.get(worker_id)
        if q:
            q[0].wake.set()

    async def call(self, worker_id: str, attempt: Callable[[], Awaitable[T]],
                   timeout: float | None = None) -> T:
        """``attempt()`` (an Allocate on ``worker_id``), waiting in the queue while it is exhausted."""
        q = self._queues.get(worker_id)
        if not q:
            try:
                return await attempt()
            except grpc.aio.AioRpcError as exc:
                if not _exhausted(exc) or self.max_wait_s <= 0:
                    raise
        q = self._queues.setdefault(worker_id, deque())
        budget = self.max_wait_s if timeout is None else max(min(timeout, self.max_wait_s), 0.0)
        if len(q) >= self.max_waiters:
            self._drop_if_empty(worker_id)
            raise QueueRefused("queue_full", f"decode worker {worker_id} has no free KV blocks and "
                               f"{len(q)} requests already wait for them (the router's queue is full)",
                               self.expected_wait_s(worker_id) or self.poll_s)
        me = _Waiter(since=self.clock())
        q.append(me)
        outcome = "cancelled"
        try:
            result = await self._wait_and_retry(worker_id, q, me, attempt, budget)
            outcome = "allocated"
            # Service interval: time since the previous waiter left, or since this one came if the
            # queue was empty before (idle time between bursts is not service time).
            now = self.clock()
            sample = now - max(self._last_out.get(worker_id, me.since), me.since)
            prev = self._interval.get(worker_id)
            self._interval[worker_id] = sample if prev is None else 0.7 * prev + 0.3 * sample
            self._last_out[worker_id] = now
            return result
        except QueueRefused:
            outcome = "refused"
            raise
        except grpc.aio.AioRpcError:
            outcome = "error"
            raise
        finally:
            q.remove(me)
            if q:
                q[0].wake.set()  # the next head tries at once
            self._drop_if_empty(worker_id)
            if self.on_wait is not None:
                self.on_wait(outcome, self.clock() - me.since)

    async def _wait_and_retry(self, worker_id: str, q: deque[_Waiter], me: _Waiter,
                              attempt: Callable[[], Awaitable[T]], budget: float) -> T:
        backoff = self.poll_s
        while True:
            left = budget - (self.clock() - me.since)
            if left <= 0:
                raise QueueRefused("no_blocks", f"decode worker {worker_id} had no free KV blocks for "
                                   f"{budget:.1f} s (waited in the router's queue)",
                                   self.expected_wait_s(worker_id) or self.poll_s)
            head = q[0] is me
            try:
                await asyncio.wait_for(me.wake.wait(), min(backoff, left) if head else left)
            except asyncio.TimeoutError:
                if head:
                    backoff = min(backoff * 2, self.max_poll_s)
            me.wake.clear()
            if q[0] is not me:
                continue
            try:
                return await attempt()
            except grpc.aio.AioRpcError as exc:
                if not _exhausted(exc):
                    raise

    def _drop_if_empty(self, worker_id: str) -> None:
        q = self._queues.get(worker_id)
        if q is not None and not q:
            del self._queues[worker_id]

    def forget(self, worker_id: str) -> None:
        """A worker left: its learned interval goes (its waiters leave by their own timeouts)."""
        self._interval.pop(worker_id, None)
        self._last_out.pop(worker_id, None)
