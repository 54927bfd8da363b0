"""Load or recompute: the per-request choice between bringing blocks back from a tier and computing them.

A tier hit pays only when its load is faster than the prefill it replaces (a lower-tier hit slower than
recomputing is the complaint users have of other tiered caches). The estimate uses what this process
measured: each tier's load bandwidth (bytes per second, moving average of real loads) and the prefill
rate (prompt tokens per second of real steps). Until the prefill rate has been measured every hit is
loaded: the first requests measure it.

For a run of matched blocks in order (each in the host or the disk tier) the plan loads the leading
``k`` blocks that save the most time, ``sum(block_tokens / prefill_rate - block_bytes / bandwidth)``
over them; a cheap host block after an expensive disk one is still taken when the sum favours both.
"""

from __future__ import annotations

from dataclasses import dataclass

_ALPHA = 0.2  # weight of the newest measurement in the moving averages
# Seeds until a tier has been measured: pinned host->device copies and a local NVMe read, conservative.
SEED_BANDWIDTH = {"host": 8e9, "disk": 1e9}


@dataclass
class TierCost:
    block_tokens: int
    block_bytes: int  # one block, every layer
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        self.bandwidth = dict(SEED_BANDWIDTH)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - _ALPHA) * old + _ALPHA * rate

    def record_load(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self.bandwidth[tier] = (1 - _ALPHA) * self.bandwidth[tier] + _ALPHA * (nbytes / seconds)

    def load_seconds(self, tier: str, blocks: int) -> float:
        return blocks * self.block_bytes / self.bandwidth[tier]

    def plan(self, tiers: list[str]) -> int:
        """How many of the leading matched blocks (``tiers[i]`` holds block ``i``) to load."""
        if self.prefill_tokens_per_s is None:
            return len(tiers)
        recompute = self.block_tokens / self.prefill_tokens_per_s
        best, best_at, saved = 0.0, 0, 0.0
        for i, tier in enumerate(tiers):
            saved += recompute - self.block_bytes / self.bandwidth[tier]
            if saved > best:
                best, best_at = saved, i + 1
        return best_at
