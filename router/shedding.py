"""Admission control: refuse at once what cannot start within its budget, instead of letting it
time out later; hold decode Allocates that found no free blocks in a bounded queue.

Past a cluster's capacity every request queues, so every request's TTFT grows until all of them miss
their targets (and the clients' deadlines). Refusing the excess at the door keeps the admitted ones
within their targets, and tells the refused ones when to come back. For each placed request the
router estimates how long it would wait before its prompt is computed, from its one picture of the
cluster (``router/state``, ``router/costs.py``):

    prefill wait   prompt tokens this router has sent the worker that will prefill it (the prefill
                   worker; the decode worker when there is no prefill pool) and not had answered,
                   over that worker's learned prefill rate
    push wait      while that prefill worker has other requests in flight: how long its recent answers
                   waited after their compute for the KV to be acknowledged (``CostModel.push_wait_s``;
                   a link slower than the prefill queues transfers behind each other, and neither the
                   compute rate nor a transfer's bandwidth shows it)
    drain wait     at least: tokens ahead of it at its prefill worker over the rate that worker's
                   answers recently drained its queue (``CostModel.drain_s``). Compute rate and push
                   wait are each one stage's view; past a link's capacity the answers come at the
                   link's pace whatever the compute rate, and this term grows with the backlog at once
                   where the push wait's average trails it (``--admission-drain``: ``on``, the default;
                   ``replace``: the drain wait stands in for the push wait, which then is not added:
                   tokens ahead that were computed and are being pushed count in the compute queue
                   already, so compute queue + push wait overstates the wait by about the push wait
                   when the link is the bottleneck; ``off``: no drain wait)
    KV wait        requests already waiting in the Allocate queue for its decode worker, times the
                   recent interval between Allocates that queue served (``allocate_queue.py``)

and refuses the request when the sum exceeds its budget: the client's deadline, or
``--max-queue-wait-s`` when that is set and shorter. The refusal is RESOURCE_EXHAUSTED with a
``retry-after-ms`` trailing-metadata entry: how much longer than its budget the wait is now (at
least ``min_retry_ms``). A placed request whose decode worker answers Allocate with RESOURCE_EXHAUSTED
waits in that worker's queue (bounded in size and time, FIFO) and is refused the same way when the
queue is full or no blocks came free in time.

Metrics (the router's registry): ``pdserve_router_admission_refused_total{reason}`` (reason
``prefill_wait`` | ``queue_full`` | ``no_blocks``), ``pdserve_router_allocate_queue_waiting`` (gauge),
``pdserve_router_allocate_queue_wait_seconds{outcome}`` (time each Allocate spent queued:
``allocated`` | ``refused`` | ``error`` | ``cancelled``), ``pdserve_router_admission_wait_estimate_seconds``
(the estimate of every admitted or refused request).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.settings import ADMISSION_DRAIN as DRAIN_MODES
from pdserve.wire import RETRY_AFTER_KEY
from router.allocate_queue import AllocateQueue, QueueRefused

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    # Refuse a request whose estimated wait exceeds this (s); 0: only the client's deadline bounds it.
    max_queue_wait_s: float = 0.0
    # The Allocate queue per decode worker: at most this many waiting, each at most this long (s).
    allocate_queue_size: int = 64
    allocate_queue_wait_s: float = 10.0
    min_retry_ms: float = 100.0
    # The prefill worker's drain wait (tokens ahead / answered rate): "on" bounds the estimate below by
    # it, "replace" puts it in the push wait's place, "off" leaves it out.
    drain: str = "on"

    def __post_init__(self) -> None:
        if self.max_queue_wait_s < 0 or self.allocate_queue_size < 0 or self.allocate_queue_wait_s < 0:
            raise ValueError("--max-queue-wait-s, --allocate-queue-size and --allocate-queue-wait-s must be "
                             f">= 0, got {self.max_queue_wait_s}, {self.allocate_queue_size}, "
                             f"{self.allocate_queue_wait_s}")
        if self.min_retry_ms < 0:
            raise ValueError(f"min_retry_ms must be >= 0, got {self.min_retry_ms}")
        if self.drain not in DRAIN_MODES:
            raise ValueError(f"--admission-drain must be one of {list(DRAIN_MODES)}, got {self.drain!r}")


class Refused(Exception):
    """RESOURCE_EXHAUSTED: full now, come back in ``retry_after_ms``."""

    def __init__(self, reason: str, message: str, retry_after_ms: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_KEY, str(int(math.ceil(self.retry_after_ms)))),)


def budget_s(deadline_s: float | None, max_queue_wait_s: float) -> float:
    """How long a request may wait to start: its deadline, or the configured bound if shorter."""
    limits = [x for x in (deadline_s, max_queue_wait_s or None) if x is not None]
    return min(limits) if limits else math.inf


def decide(wait_s: float, budget: float, min_retry_ms: float) -> float | None:
    """None: admit. Else the retry hint (ms): the excess wait, at least ``min_retry_ms``."""
    if wait_s <= budget:
        return None
    return max(min_retry_ms, (wait_s - budget) * 1e3)


def prefill_wait_s(placer: Any, placement: Any, request_id: str, *, drain: str = "on") -> float:
    """The prefill wait of a placed request, from the placer's picture of the cluster: tokens ahead
    of it at the worker that will prefill it, over that worker's learned rate, plus that worker's recent
    push wait while others are in flight there; ``drain`` (``DRAIN_MODES``) "on": at least the tokens
    ahead over the rate that prefill worker's answers drained its queue, "replace": the larger of that
    and the compute queue, without the push wait (0 if nothing is known)."""
    view, costs = getattr(placer, "view", None), getattr(placer, "costs", None)
    if view is None or costs is None or not hasattr(view, "outstanding_tokens"):
        return 0.0
    prefill_id = getattr(placement, "prefill_id", "")
    worker = prefill_id or placement.decode.worker_id
    ahead = view.outstanding_tokens(worker) - view.own_prefill_tokens(request_id)
    wait = costs.queue_s(worker, ahead)
    # A backlog of pushes exists only while other requests are there: an idle worker (e.g. once
    # everything was refused) gets no push wait, so the next request is admitted and measures anew.
    own = 1 if view.prefill_of(request_id) == prefill_id else 0  # this request, placed there already
    others = view.inflight(prefill_id) - own if prefill_id else 0
    if others > 0 and drain != "replace":
        wait += costs.push_wait_s(prefill_id)
    if drain != "off" and prefill_id:
        wait = max(wait, costs.drain_s(prefill_id, ahead))
    return wait


class Admission:
    def __init__(self, config: AdmissionConfig, placer: Any = None, *, registry: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.placer = placer
        self.metrics = _Metrics(registry) if registry is not None else None
        self.queue = AllocateQueue(max_waiters=config.allocate_queue_size,
                                   max_wait_s=config.allocate_queue_wait_s, clock=clock, on_wait=self._waited)
        if self.metrics is not None:
            self.metrics.waiting.set_function(self.queue.waiting)

    def estimate_s(self, request_id: str, placement: Any) -> float:
        return (prefill_wait_s(self.placer, placement, request_id, drain=self.config.drain)
                + self.queue.expected_wait_s(placement.decode.worker_id))

    def check(self, request_id: str, placement: Any, deadline_s: float | None, *,
              wait_s: float | None = None) -> float:
        """Raise Refused if the placed request would wait past its budget (``wait_s``: a given
        estimate instead of the cluster picture's); else return the estimate (s)."""
        wait = self.estimate_s(request_id, placement) if wait_s is None else wait_s
        budget = budget_s(deadline_s, self.config.max_queue_wait_s)
        if self.metrics is not None:
            self.metrics.estimate.observe(wait)
        retry = decide(wait, budget, self.config.min_retry_ms)
        if retry is not None:
            self._refused("prefill_wait")
            raise Refused("prefill_wait", f"overloaded: this request would wait ~{wait:.2f} s to start, "
                          f"beyond its budget of {budget:.2f} s; retry in {retry / 1e3:.1f} s", retry)
        return wait

    async def allocate(self, worker_id: str, attempt: Callable[[], Awaitable[T]],
                       deadline_s: float | None) -> T:
        """``attempt()`` (the decode Allocate), queued while the worker has no free blocks."""
        try:
            return await self.queue.call(worker_id, attempt, deadline_s)
        except QueueRefused as exc:
            self._refused(exc.reason)
            raise Refused(exc.reason, f"overloaded: {exc}",
                          max(self.config.min_retry_ms, exc.retry_after_s * 1e3)) from None

    def freed(self, worker_id: str) -> None:
        """A request on ``worker_id`` ended: its blocks are free, the queue's head retries."""
        self.queue.wake(worker_id)

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.refused.labels(reason=reason).inc()

    def _waited(self, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.wait.labels(outcome=outcome).observe(seconds)


class _Metrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
        self.refused = Counter("pdserve_router_admission_refused", "Requests refused with RESOURCE_EXHAUSTED "
                               "by admission control", ["reason"], registry=registry)
        self.estimate = Histogram("pdserve_router_admission_wait_estimate_seconds", "Estimated wait to start "
                                  "of each placed request", buckets=buckets, registry=registry)
        self.waiting = Gauge("pdserve_router_allocate_queue_waiting", "Decode Allocates waiting for free "
                             "KV blocks in the router's queue", registry=registry)
        self.wait = Histogram("pdserve_router_allocate_queue_wait_seconds", "Time a decode Allocate spent "
                              "in the router's queue", ["outcome"], buckets=buckets, registry=registry)
