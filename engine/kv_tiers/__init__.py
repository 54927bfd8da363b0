"""Tiers behind the paged KV cache: host memory, then local disk (``engine.kv_tiers.tiers``)."""

from engine.kv_tiers.tiers import KVTiers, LoadHandle, TierConfig

__all__ = ["KVTiers", "LoadHandle", "TierConfig"]
