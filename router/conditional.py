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
estimated transfer time > estimated local recompute time -> local ("transfer_slower"); the prefill
worker's queue is longer than ``max_prefill_wait_s`` and recomputing locally beats waiting for it ->
local ("prefill_busy"); else remote ("disaggregate"). Any local choice needs the decode worker's
local-prefill budget (``local_duty`` of its time, ``local_burst_s`` at once; router/prefill_load.py):
without it the prompt goes to the prefill pool ("local_budget"), so a short-prompt flood or a long
prefill queue cannot turn the decode GPU into a second, interfering prefill GPU.

Transfer time = per-transfer latency + uncached x KV bytes per token / link bandwidth (a measured
link beats the configured default). Recompute time = uncached / local prefill rate, plus the
attention over the cached prefix (it grows with ``cached x uncached``), scaled by how busy the decode
worker is (a loaded decode batch makes local prefill cost its other requests more). The prefill
queue's wait is what this router has in flight there over that worker's learned rate.

The load rule is what Dynamo calls conditional disaggregation by queue length: under a burst the
prefill GPU's queue (and with it TTFT) grows while the decode GPU has spare compute; handing it a
budgeted share of the prompts keeps TTFT bounded at a small, bounded cost in decode stalls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

from router.prefill_load import LocalBudget, PrefillQueue


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
    # Load rule: prefill locally when the prefill worker's estimated queue wait exceeds this (s); 0 = off.
    max_prefill_wait_s: float = 0.5
    # Budget of every local prefill: at most this share of a decode worker's time (1 = no limit), and at
    # most local_burst_s seconds of prefill back to back.
    local_duty: float = 0.25
    local_burst_s: float = 0.25

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("min_uncached_tokens must be >= 0 and kv_bytes_per_token > 0")
        for name in ("default_link_gbps", "local_prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ConditionalConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.local_duty <= 1:
            raise ValueError(f"ConditionalConfig.local_duty must be in (0, 1], got {self.local_duty}")
        for name in ("transfer_latency_s", "attention_s_per_token_pair", "load_weight", "max_prefill_wait_s",
                     "local_burst_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ConditionalConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Decision:
    local: bool
    # "disabled" | "short_suffix" | "transfer_slower" | "prefill_busy" | "local_budget" | "disaggregate"
    reason: str
    uncached_tokens: int
    transfer_s: float
    recompute_s: float
    prefill_wait_s: float = 0.0  # the prefill worker's estimated queue when this was decided

    def to_dict(self) -> dict:
        return asdict(self)


def decide(*, prompt_tokens: int, cached_tokens: int, config: ConditionalConfig,
           link_gbps: float | None = None, decode_running: int = 0, decode_capacity: int = 1,
           prefill_wait_s: float = 0.0, local_budget_s: float = math.inf) -> Decision:
    """Prefill locally on the decode worker (``local=True``) or disaggregate; see the module doc.

    ``prefill_wait_s``: the prefill worker's estimated queue; ``local_budget_s``: the decode worker's
    local-prefill seconds left (a prompt fits if it costs no more, or the bucket is at least full)."""
    if prompt_tokens <= 0 or cached_tokens < 0:
        raise ValueError(f"need prompt_tokens > 0 and cached_tokens >= 0, got {prompt_tokens}, "
                         f"{cached_tokens}")
    cached = min(cached_tokens, prompt_tokens - 1)  # the last prompt token is always computed
    uncached = prompt_tokens - cached
    gbps = link_gbps if link_gbps and link_gbps > 0 else config.default_link_gbps
    transfer = config.transfer_latency_s + uncached * config.kv_bytes_per_token / (gbps * 1e9)
    load = 1.0 + config.load_weight * max(decode_running, 0) / max(decode_capacity, 1)
    base = local_cost_s(uncached, cached, config)
    recompute = load * base
    wait = max(prefill_wait_s, 0.0)
    if not config.enabled:
        reason = "disabled"
    elif uncached <= config.min_uncached_tokens:
        reason = "short_suffix"
    elif transfer > recompute:
        reason = "transfer_slower"
    elif 0 < config.max_prefill_wait_s < wait and recompute < wait + base + transfer:
        reason = "prefill_busy"  # remote: queue + the same compute + the transfer
    else:
        reason = "disaggregate"
    local = reason in LOCAL_REASONS
    if local and local_budget_s < min(base, config.local_burst_s):
        local, reason = False, "local_budget"
    return Decision(local=local, reason=reason, uncached_tokens=uncached, transfer_s=transfer,
                    recompute_s=recompute, prefill_wait_s=wait)


LOCAL_REASONS = ("short_suffix", "transfer_slower", "prefill_busy")


def local_cost_s(uncached: int, cached: int, config: ConditionalConfig) -> float:
    """Seconds the decode worker's GPU spends prefilling ``uncached`` tokens after ``cached`` ones."""
    return (uncached / config.local_prefill_tokens_per_s
            + config.attention_s_per_token_pair * uncached * (cached + uncached / 2))


class PrefillModePolicy:
    """The router's side: feeds ``decide`` what it knows about a placed (prefill, decode) pair.

    Inputs: the decode worker's cached prefix (from its Allocate), its last GetStats (load, batch
    capacity, KV bytes per block), the placer's measured bandwidth for the pair (only when measured;
    else the configured default), the prefill worker's queue as this router sees it (``prefill_sent`` /
    ``prefill_answered`` around every Prefill call) and the decode worker's local-prefill budget, which
    every local decision spends. Every decision is counted in
    ``pdserve_router_prefill_decisions_total{mode, reason}`` on the placer's metrics registry.
    ``colocated``: there is no prefill pool, every prompt is prefilled where it decodes.
    """

    def __init__(self, config: ConditionalConfig | None, placer: Any, *, colocated: bool = False) -> None:
        self.config = config if config is not None else ConditionalConfig(enabled=False)
        self.placer = placer
        self.colocated = colocated
        self.counter = _decisions_counter(getattr(getattr(placer, "metrics", None), "registry", None))
        self._by_kv_bytes: dict[int, ConditionalConfig] = {}
        self.queue = PrefillQueue(self.config.local_prefill_tokens_per_s)
        self.budget = LocalBudget(self.config.local_duty, self.config.local_burst_s)

    def decide(self, req: Any, cached_tokens: int, p: Any, d: Any) -> Decision:
        n = len(req.prompt_ids)
        if self.colocated:
            out = Decision(local=True, reason="colocated", uncached_tokens=n - min(cached_tokens, n - 1),
                           transfer_s=0.0, recompute_s=0.0)
        else:
            stats = d.stats
            cfg = self._config_for(stats)
            links = getattr(self.placer, "links", None)
            gbps = None
            if p is not None and links is not None and links.measured(p.worker_id, d.worker_id):
                gbps = links.bandwidth(p.worker_id, d.worker_id) / 1e9
            out = decide(prompt_tokens=n, cached_tokens=cached_tokens, config=cfg,
                         link_gbps=gbps, decode_running=stats.num_running if stats else 0,
                         decode_capacity=(stats.max_num_seqs if stats else 0) or 1,
                         prefill_wait_s=self.queue.wait_s(p.worker_id) if p is not None else 0.0,
                         local_budget_s=self.budget.available(d.worker_id))
            if out.local:
                cached = n - out.uncached_tokens
                self.budget.take(d.worker_id, local_cost_s(out.uncached_tokens, cached, cfg))
        if self.counter is not None:
            self.counter.labels(mode="local" if out.local else "remote", reason=out.reason).inc()
        return out

    def prefill_sent(self, prefill_worker_id: str, uncached_tokens: int) -> int:
        """A Prefill call goes to that worker: its tokens join the queue estimate until answered."""
        return self.queue.begin(prefill_worker_id, uncached_tokens)

    def prefill_answered(self, ticket: int, *, compute_s: float = 0.0, computed_tokens: int = 0) -> None:
        """The call ended; an answer's compute time teaches the worker's rate (idempotent)."""
        self.queue.end(ticket, compute_s=compute_s, computed_tokens=computed_tokens)

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
