"""Conditional disaggregation: should the decode worker prefill a prompt itself?

Disaggregation pays a fixed price per request (a prefill RPC, a transfer handshake, moving the KV of
the uncached suffix) to keep long prefills from stalling the decode batch. For a short uncached
suffix — a short prompt, or the next turn of a chat whose history the decode worker still caches —
that price exceeds what it saves, and the decode worker should compute the suffix locally. The
decision is a pure function of numbers the router already has after ``Allocate`` (prompt length,
the decode worker's cached prefix) and a few configured or measured rates::

    cfg = ConditionalConfig(min_uncached_tokens=256, kv_bytes_per_token=131072)
    d = decide(prompt_tokens=4096, cached_tokens=3840, config=cfg, link_gbps=measured)
    d.local      # True: 256 uncached tokens, below the threshold -> prefill on the decode worker
    d.to_dict()  # reported per request (reason, uncached tokens, both estimates)

Rules, in order: disabled -> remote; ``uncached <= min_uncached_tokens`` -> local ("short_suffix");
estimated transfer time > estimated local recompute time -> local ("transfer_slower"); else remote.
Transfer time = per-transfer latency + uncached x KV bytes per token / link bandwidth (a measured
link beats the configured default). Recompute time = uncached / local prefill rate, plus the
attention over the cached prefix (it grows with ``cached x uncached``), scaled by how busy the decode
worker is (a loaded decode batch makes local prefill cost its other requests more).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ConditionalConfig:
    enabled: bool = True
    # At or below this many uncached prompt tokens the decode worker prefills locally.
    min_uncached_tokens: int = 256
    # KV bytes one token occupies over all layers (llama3-8b bf16: 32 x 2 x 8 x 128 x 2 = 131072).
    kv_bytes_per_token: int = 131072
    # Link to assume when none was measured (GB/s) and fixed cost per transfer (handshake, RPC) in s.
    default_link_gbps: float = 25.0
    transfer_latency_s: float = 0.003
    # Decode worker's local prefill rate (tokens/s) and the attention term per (cached x uncached) token
    # pair, seconds; measured per GPU type (bench/gpu.py prefill numbers give the first).
    local_prefill_tokens_per_s: float = 30000.0
    attention_s_per_token_pair: float = 2e-10
    # Local prefill delays every request in the decode batch: recompute cost x (1 + weight x running/cap).
    load_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("min_uncached_tokens must be >= 0 and kv_bytes_per_token > 0")
        for name in ("default_link_gbps", "local_prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ConditionalConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("transfer_latency_s", "attention_s_per_token_pair", "load_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"ConditionalConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Decision:
    local: bool
    reason: str  # "disabled" | "short_suffix" | "transfer_slower" | "disaggregate"
    uncached_tokens: int
    transfer_s: float
    recompute_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def decide(*, prompt_tokens: int, cached_tokens: int, config: ConditionalConfig,
           link_gbps: float | None = None, decode_running: int = 0, decode_capacity: int = 1) -> Decision:
    """Prefill locally on the decode worker (``local=True``) or disaggregate; see the module doc."""
    if prompt_tokens <= 0 or cached_tokens < 0:
        raise ValueError(f"need prompt_tokens > 0 and cached_tokens >= 0, got {prompt_tokens}, "
                         f"{cached_tokens}")
    cached = min(cached_tokens, prompt_tokens - 1)  # the last prompt token is always computed
    uncached = prompt_tokens - cached
    gbps = link_gbps if link_gbps and link_gbps > 0 else config.default_link_gbps
    transfer = config.transfer_latency_s + uncached * config.kv_bytes_per_token / (gbps * 1e9)
    load = 1.0 + config.load_weight * max(decode_running, 0) / max(decode_capacity, 1)
    recompute = load * (uncached / config.local_prefill_tokens_per_s
                        + config.attention_s_per_token_pair * uncached * (cached + uncached / 2))
    if not config.enabled:
        reason = "disabled"
    elif uncached <= config.min_uncached_tokens:
        reason = "short_suffix"
    elif transfer > recompute:
        reason = "transfer_slower"
    else:
        reason = "disaggregate"
    return Decision(local=reason in ("short_suffix", "transfer_slower"), reason=reason,
                    uncached_tokens=uncached, transfer_s=transfer, recompute_s=recompute)


class PrefillModePolicy:
    """The router's side: feeds ``decide`` what it knows about a placed (prefill, decode) pair.

    Inputs: the decode worker's cached prefix (from its Allocate), its last GetStats (load, batch
    capacity, KV bytes per block), and the placer's measured bandwidth for the pair (only when
    measured; else the configured default). Every decision is counted in
    ``pdserve_router_prefill_decisions_total{mode, reason}`` on the placer's metrics registry.
    ``colocated``: there is no prefill pool, every prompt is prefilled where it decodes.
    """

    def __init__(self, config: ConditionalConfig | None, placer: Any, *, colocated: bool = False) -> None:
        self.config = config if config is not None else ConditionalConfig(enabled=False)
        self.placer = placer
        self.colocated = colocated
        self.counter = _decisions_counter(getattr(getattr(placer, "metrics", None), "registry", None))
        self._by_kv_bytes: dict[int, ConditionalConfig] = {}

    def decide(self, req: Any, cached_tokens: int, p: Any, d: Any) -> Decision:
        n = len(req.prompt_ids)
        if self.colocated:
            out = Decision(local=True, reason="colocated", uncached_tokens=n - min(cached_tokens, n - 1),
                           transfer_s=0.0, recompute_s=0.0)
        else:
            stats = d.stats
            links = getattr(self.placer, "links", None)
            gbps = None
            if p is not None and links is not None and links.measured(p.worker_id, d.worker_id):
                gbps = links.bandwidth(p.worker_id, d.worker_id) / 1e9
            out = decide(prompt_tokens=n, cached_tokens=cached_tokens, config=self._config_for(stats),
                         link_gbps=gbps, decode_running=stats.num_running if stats else 0,
                         decode_capacity=(stats.max_num_seqs if stats else 0) or 1)
        if self.counter is not None:
            self.counter.labels(mode="local" if out.local else "remote", reason=out.reason).inc()
        return out

    def _config_for(self, stats: Any) -> ConditionalConfig:
        """The configured rates with the decode worker's real KV size per token, when it reports one."""
        per_block = int(getattr(stats, "kv_bytes_per_block", 0) or 0)
        block_size = int(getattr(stats, "block_size", 0) or 0)
        if not (per_block and block_size):
            return self.config
        per_token = max(1, per_block // block_size)
        cfg = self._by_kv_bytes.get(per_token)
        if cfg is None:
            cfg = dataclasses.replace(self.config, kv_bytes_per_token=per_token)
            self._by_kv_bytes[per_token] = cfg
        return cfg


def _decisions_counter(registry: Any) -> Any:
    if registry is None:
        return None
    from prometheus_client import Counter

    name = "pdserve_router_prefill_decisions"
    existing = getattr(registry, "_names_to_collectors", {}).get(name)
    if existing is not None:  # a second pipeline on the same placer (tests)
        return existing
    return Counter(name, "Where prompts were prefilled: mode remote (prefill pool) | local (decode "
                   "worker), with the conditional-disaggregation reason", ["mode", "reason"],
                   registry=registry)
