"""Histograms of the engine's steps: how long each took, how many requests and tokens it carried.

The engine keeps its own cumulative buckets (no metrics library here: the engine knows no exporter);
``pdserve/app/worker_metrics.py`` turns them into Prometheus histograms at scrape time
(``pdserve_worker_step_seconds``, ``_step_batch_size``, ``_step_tokens``). Observed on the engine
thread, read by the scrape thread: a scrape may see one step half counted, never a torn number.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

STEP_SECONDS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2,
                0.5, 1.0, 2.0, 5.0)
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
STEP_TOKENS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Buckets:
    """Counts per upper bound (the last one +Inf), their sum and count: a Prometheus histogram's state."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(upper bound, count at or below it), ..., (inf, count)]``, as Prometheus exposes them."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), list(self.counts), strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass
class StepHistograms:
    seconds: Buckets = field(default_factory=lambda: Buckets(STEP_SECONDS))
    batch_size: Buckets = field(default_factory=lambda: Buckets(BATCH_SIZES))
    tokens: Buckets = field(default_factory=lambda: Buckets(STEP_TOKENS))

    def observe(self, seconds: float, batch_size: int, tokens: int) -> None:
        self.seconds.observe(seconds)
        self.batch_size.observe(batch_size)
        self.tokens.observe(tokens)
