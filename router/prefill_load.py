"""What the router knows of the load on each side of a placed pair, for load-aware conditional
disaggregation (``router/conditional.py``).

Two pieces of state, each keyed by worker id:

* ``PrefillQueue``: the uncached prompt tokens this router has sent to a prefill worker and not yet
  had answered, and that worker's prefill rate (tokens/s), learned from the ``compute_s`` its
  ``PrefillResponse`` reports. ``wait_s(p)`` = outstanding tokens / rate: how long a new prompt would
  queue there. The router's own in-flight count is current to the request (a ``GetStats`` poll is
  ``--stats-interval`` old); a second router in front of the same pool is not seen (its share shows up
  as slower answers, not as queue).
* ``LocalBudget``: a token bucket of prefill seconds per decode worker. Every prompt a decode worker
  prefills itself stalls its whole decode batch for that long; the bucket refills at ``duty`` seconds
  per second up to ``burst_s``, so local prefill never takes more than that share of a decode GPU
  however long the prefill queue grows (the p90 inter-token latency stays a decode step's).

Why the rate is a slowly decaying maximum and not a mean: with ``--max-num-batched-tokens`` above the
prompt length the prefill engine computes two queued prompts in one step, and each then reports the
step's whole time as its ``compute_s``. Those samples halve the apparent rate exactly when the queue is
long; the single-prompt samples between them carry the engine's real rate.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class PrefillQueue:
    def __init__(self, default_tokens_per_s: float, *, decay_per_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not default_tokens_per_s > 0:
            raise ValueError(f"default_tokens_per_s must be > 0, got {default_tokens_per_s}")
        self.default = default_tokens_per_s
        self.decay_per_s = decay_per_s
        self.clock = clock
        self._outstanding: dict[str, int] = {}
        self._tickets: dict[int, tuple[str, int]] = {}
        self._rate: dict[str, tuple[float, float]] = {}  # worker -> (tokens/s, when learned)
        self._ids = itertools.count(1)

    def begin(self, worker_id: str, tokens: int) -> int:
        """A Prefill call of ``tokens`` uncached tokens goes out; the ticket ends it (``end``)."""
        ticket = next(self._ids)
        tokens = max(int(tokens), 0)
        self._tickets[ticket] = (worker_id, tokens)
        self._outstanding[worker_id] = self._outstanding.get(worker_id, 0) + tokens
        return ticket

    def end(self, ticket: int, *, compute_s: float = 0.0, computed_tokens: int = 0) -> None:
        """The call returned (or failed: no sample). Idempotent, so a ``finally`` may call it again."""
        got = self._tickets.pop(ticket, None)
        if got is None:
            return
        worker, tokens = got
        left = self._outstanding.get(worker, 0) - tokens
        if left > 0:
            self._outstanding[worker] = left
        else:
            self._outstanding.pop(worker, None)
        if compute_s > 0 and computed_tokens > 0:
            self._learn(worker, computed_tokens / compute_s)

    def _learn(self, worker: str, sample: float) -> None:
        now = self.clock()
        rate = self.rate(worker, now)
        seen = worker in self._rate
        self._rate[worker] = (max(sample, rate) if seen else sample, now)

    def rate(self, worker_id: str, now: float | None = None) -> float:
        """Tokens/s: the best recent sample, decaying by ``decay_per_s`` a second towards newer ones."""
        got = self._rate.get(worker_id)
        if got is None:
            return self.default
        rate, when = got
        age = max((self.clock() if now is None else now) - when, 0.0)
        return rate * math.exp(-self.decay_per_s * age)

    def outstanding(self, worker_id: str) -> int:
        return self._outstanding.get(worker_id, 0)

    def wait_s(self, worker_id: str) -> float:
        """How long a prompt sent now would queue on that worker behind this router's others."""
        return self.outstanding(worker_id) / self.rate(worker_id)


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
