"""Tiers behind the paged KV cache: host memory, then local disk (``engine.kv_tiers.tiers``).

The package imports nothing heavy itself: the router reads ``engine.kv_tiers.cost`` (the load-or-
recompute model both sides share) without importing torch.
"""

from __future__ import annotations

__all__ = ["KVTiers", "LoadHandle", "TierConfig"]


def __getattr__(name: str):
    if name == "TierConfig":
        from engine.kv_tiers.config import TierConfig

        return TierConfig
    if name in __all__:
        from engine.kv_tiers import tiers

        return getattr(tiers, name)
    raise AttributeError(f"module 'engine.kv_tiers' has no attribute {name!r}")
