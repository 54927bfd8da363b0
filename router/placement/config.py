"""PlacerConfig: every placement knob in one frozen, validated dataclass (see docs/router.md).

The seconds a path costs are not placement knobs: they come from the router's one cost model
(``router/costs.py``, configured by ``costs``), which the conditional decision shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.costs import CostConfig
from router.placement.types import POLICIES


@dataclass(frozen=True, kw_only=True)
class PlacerConfig:
    policy: str = "prefix"
    # False: the router fronts colocated workers (no prefill pool): placement picks a decode worker
    # only and every prompt is prefilled where it decodes.
    prefill_pool: bool = True
    # Bounded load: no worker takes more than ceil((1 + epsilon) * average) in-flight when others have room.
    epsilon: float = 0.25
    # A session's bound worker is over the session load bound (and the session moves) above
    # (1 + session_epsilon) x (the other workers' average + 1)...
    session_epsilon: float = 1.0
    # ...and only when it has at least this many requests: at low load, affinity always wins.
    session_min_load: int = 4
    session_ttl_s: float = 600.0
    max_sessions: int = 200_000
    block_size: int = 16
    costs: CostConfig = field(default_factory=CostConfig)
    # Router-side approximate prefix index: blocks remembered per worker (LRU beyond that).
    index_blocks_per_worker: int = 32_768
    # Blocks beyond the matched prefix added to the index at placement time (the rest on the outcome).
    optimistic_blocks: int = 32
    # Pair search considers the best top_k of each pool (pruning keeps 64-worker decisions cheap).
    top_k: int = 6
    unhealthy_cooldown_s: float = 5.0
    load_stale_s: float = 15.0  # load reports older than this are ignored
    # Shared-store sync (Redis): background refresh period of workers/loads, and per-call timeout.
    sync_interval_s: float = 0.5
    store_timeout_s: float = 0.05

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.epsilon < 0 or self.session_epsilon < 0:
            raise ValueError("epsilon and session_epsilon must be >= 0")
        if self.session_min_load < 0 or self.optimistic_blocks < 0:
            raise ValueError("session_min_load and optimistic_blocks must be >= 0")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.session_ttl_s <= 0 or self.max_sessions <= 0:
            raise ValueError("session_ttl_s and max_sessions must be positive")
        for name in ("sync_interval_s", "store_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("unhealthy_cooldown_s", "load_stale_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.index_blocks_per_worker <= 0 or self.top_k <= 0:
            raise ValueError("index_blocks_per_worker and top_k must be positive")

    @property
    def session_aware(self) -> bool:
        """A request's session id binds it to a pair (every policy but the explicit single-pool ones
        and ``prefix_only``)."""
        return self.policy in ("prefix", "session+prefix")

    @property
    def scored(self) -> bool:
        """Pairs are chosen by the cost model (the prefix policies)."""
        return self.policy in ("prefix", "session+prefix", "prefix_only")
