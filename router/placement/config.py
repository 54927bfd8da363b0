"""PlacerConfig: every placement knob in one frozen, validated dataclass (see docs/router.md)."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.types import POLICIES


@dataclass(frozen=True, kw_only=True)
class PlacerConfig:
    policy: str = "prefix"
    # Bounded load: no worker takes more than ceil((1 + epsilon) * average) in-flight when others have room.
    epsilon: float = 0.25
    # A session's bound pair counts as overloaded (and the session moves) above (1 + session_epsilon) x avg.
    session_epsilon: float = 1.0
    # ...and only when it has at least this many requests: at low load, affinity always wins.
    session_min_load: int = 4
    session_ttl_s: float = 600.0
    max_sessions: int = 200_000
    block_size: int = 16
    # Cost model, in seconds (see docs/router.md "Scoring").
    prefill_tokens_per_s: float = 8000.0
    queue_cost_s: float = 0.05  # expected wait per request already queued/running on a worker
    kv_pressure_cost_s: float = 0.05  # penalty scale for a decode worker with little free KV
    kv_bytes_per_block: int = 256 * 1024  # until learnt from outcomes (bytes_sent / blocks_sent)
    default_bandwidth_Bps: float = 1.0e9  # per (prefill, decode) link until measured
    bandwidth_ewma_alpha: float = 0.3
    min_bandwidth_sample_bytes: int = 64 * 1024  # smaller transfers are latency, not bandwidth
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
        for name in ("prefill_tokens_per_s", "default_bandwidth_Bps", "sync_interval_s", "store_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("queue_cost_s", "kv_pressure_cost_s", "unhealthy_cooldown_s", "load_stale_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 < self.bandwidth_ewma_alpha <= 1:
            raise ValueError("bandwidth_ewma_alpha must be in (0, 1]")
        if self.kv_bytes_per_block <= 0 or self.index_blocks_per_worker <= 0 or self.top_k <= 0:
            raise ValueError("kv_bytes_per_block, index_blocks_per_worker and top_k must be positive")

    @property
    def session_aware(self) -> bool:
        return self.policy == "session+prefix"
