"""The decode workers' local-prefill budget, for conditional disaggregation (``router/conditional.py``).

``LocalBudget``: a token bucket of prefill seconds per decode worker. Every prompt a decode worker
prefills itself stalls its whole decode batch for that long; the bucket refills at ``duty`` seconds
per second up to ``burst_s``, so local prefill never takes more than that share of a decode GPU
however long the prefill queue grows (the p90 inter-token latency stays a decode step's).

The queues themselves (prompt tokens sent to a worker and not yet answered) are in the router's one
picture of the cluster (``router/state/workers.py``), the rates in its one cost model
(``router/costs.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    level: float
    when: float


@dataclass
class LocalBudget:
    """Prefill seconds a decode worker may still spend on local prefills (a token bucket)."""

    duty: float
    burst_s: float
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.duty <= 1 or self.burst_s < 0:
            raise ValueError(f"need 0 < duty <= 1 and burst_s >= 0, got {self.duty}, {self.burst_s}")

    @property
    def unlimited(self) -> bool:
        return self.duty >= 1.0

    def available(self, worker_id: str) -> float:
        if self.unlimited:
            return math.inf
        return self._refill(worker_id).level

    def take(self, worker_id: str, seconds: float) -> None:
        """Spend ``seconds`` (the level may go below zero: one prompt larger than the burst still runs
        once, and the bucket is in debt until it refills)."""
        if not self.unlimited:
            self._refill(worker_id).level -= max(seconds, 0.0)

    def _refill(self, worker_id: str) -> _Bucket:
        now = self.clock()
        b = self._buckets.get(worker_id)
        if b is None:
            b = self._buckets[worker_id] = _Bucket(self.burst_s, now)
        else:
            b.level = min(self.burst_s, b.level + (now - b.when) * self.duty)
            b.when = now
        return b
