"""The router's one cost model: seconds a request will spend on each path, from learned rates.

Placement (which prefill / decode pair) and conditional disaggregation (prefill on the prefill
worker or on the decode worker) ask the same questions — how long will ``n`` uncached tokens take to
prefill on worker ``w``, how long will ``b`` KV blocks take to cross the link ``(p, d)``, how long
will a prompt wait behind what is already queued there — so they ask this one object, and whatever
it learns from one request sharpens both decisions for the next.

What it learns, per worker or link, from what the workers report on every request:

* **prefill rate** (tokens/s) of each worker that computed a prompt, from ``compute_s`` and the
  tokens it computed (``PrefillResponse``, or a decode worker's local prefill in its final facts).
  Kept as a slowly decaying maximum, not a mean: with ``--max-num-batched-tokens`` above the prompt
  length the engine computes two queued prompts in one step and each reports the whole step's time,
  so those samples halve the apparent rate exactly when the queue is long; the single-prompt samples
  between them carry the engine's real rate.
* **link bandwidth** (bytes/s) of each (prefill, decode) pair, an EWMA of one-piece pushes
  (``LinkStats``; small transfers are latency, not bandwidth, and are no sample).
* **KV bytes per token** of each decode worker, from its ``GetStats`` (exact, not learned).
* **push wait** of each prefill worker: how long its recent answers waited, after their prompt was
  computed, for the receiver to acknowledge the KV (``kv_wait_ms``), an EWMA that fades with age
  (``push_wait_s``). On a link slower than the prefill (TCP past ~10 req/s of the llama3-8b shape on
  2x H200) transfers queue behind each other and this is where a request's TTFT goes: compute rate and
  per-transfer bandwidth both miss it (a transfer's bytes over its time include its queueing).
* **drain rate** of each prefill worker: the prompt tokens its answers carry per second of its busy
  time (``observe_answer``; busy = it had prompts outstanding, from its previous answer or from when it
  last left idle). Whatever the bottleneck behind the worker (its compute, the KV link, the decode
  worker's receiver), this is the rate its queue empties at, so ``drain_s`` (tokens ahead over it) is
  the wait that queue means by Little's law. Kept as two EWMAs (tokens per answer, busy seconds per
  answer) whose ratio is the rate: answers come in bursts when transfers overlap, and a ratio of sums
  does not blow up on the short gaps.

Until a rate is learned the configured prior stands (``--local-prefill-tokens-per-s``, one number
for every worker of the model, and ``default_bandwidth_Bps`` for a link).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_tiers.cost import SEED_BANDWIDTH as TIER_BANDWIDTH


class LinkStats:
    """Measured prefill->decode bandwidth per pair (EWMA) and the KV size of one block (learnt from
    ``bytes_sent / blocks_sent``, for when no worker reported its layout)."""

    def __init__(self, *, default_Bps: float, alpha: float, min_sample_bytes: int,
                 bytes_per_block: int) -> None:
        self.default_Bps = default_Bps
        self.alpha = alpha
        self.min_sample_bytes = min_sample_bytes
        self.bytes_per_block = float(bytes_per_block)
        # rows[prefill_id][decode_id] = bytes/s; nested so scoring looks up a prefill's row once.
        self.rows: dict[str, dict[str, float]] = {}

    def bandwidth(self, prefill_id: str, decode_id: str) -> float:
        return self.rows.get(prefill_id, {}).get(decode_id, self.default_Bps)

    def measured_from(self, prefill_id: str) -> bool:
        """Whether any link from ``prefill_id`` was measured."""
        return prefill_id in self.rows

    def observe(self, prefill_id: str, decode_id: str, *, bytes_sent: int, seconds: float,
                blocks_sent: int) -> None:
        if blocks_sent > 0 and bytes_sent > 0:
            per = bytes_sent / blocks_sent
            self.bytes_per_block += self.alpha * (per - self.bytes_per_block)
        if bytes_sent < self.min_sample_bytes or seconds <= 0:
            return
        sample = bytes_sent / seconds
        row = self.rows.setdefault(prefill_id, {})
        old = row.get(decode_id)
        row[decode_id] = sample if old is None else old + self.alpha * (sample - old)

    def forget(self, worker_id: str) -> None:
        self.rows.pop(worker_id, None)
        for p in [p for p, row in self.rows.items() if row.pop(worker_id, None) is not None and not row]:
            del self.rows[p]


@dataclass(frozen=True, kw_only=True)
class CostConfig:
    # A worker's prefill rate until one of its answers teaches the real one (tokens/s).
    prefill_tokens_per_s: float = 30000.0
    # A (prefill, decode) link until a transfer over it was measured (bytes/s), and the fixed cost
    # of one transfer (handshake, RPC), seconds.
    default_bandwidth_Bps: float = 25.0e9
    transfer_latency_s: float = 0.003
    # KV bytes of one token until the decode worker reports its layout (llama3-8b bf16).
    kv_bytes_per_token: int = 131072
    # Attention over a cached prefix while computing the suffix: seconds per (cached x uncached) pair.
    attention_s_per_token_pair: float = 2e-10
    # How fast a learned prefill rate decays towards newer samples (1/s).
    rate_decay_per_s: float = 0.02
    bandwidth_ewma_alpha: float = 0.3
    min_bandwidth_sample_bytes: int = 64 * 1024
    # The push wait's EWMA weight of a new sample, and its fading with age (1/s): a backlog seen a few
    # seconds ago says little about the link now.
    push_wait_alpha: float = 0.3
    push_wait_decay_per_s: float = 0.5
    # The drain rate's EWMA weight of one answer (~1/alpha answers in its memory).
    drain_alpha: float = 0.1

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "default_bandwidth_Bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("transfer_latency_s", "attention_s_per_token_pair", "rate_decay_per_s",
                     "min_bandwidth_sample_bytes", "push_wait_decay_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"CostConfig.kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")
        for name in ("bandwidth_ewma_alpha", "push_wait_alpha", "drain_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"CostConfig.{name} must be in (0, 1], got {getattr(self, name)}")


class CostModel:
    def __init__(self, config: CostConfig | None = None, *, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = cfg = config or CostConfig()
        self.block_size = block_size
        self.clock = clock
        self.links = LinkStats(default_Bps=cfg.default_bandwidth_Bps, alpha=cfg.bandwidth_ewma_alpha,
                               min_sample_bytes=cfg.min_bandwidth_sample_bytes,
                               bytes_per_block=cfg.kv_bytes_per_token * block_size)
        self._rate: dict[str, tuple[float, float]] = {}  # worker -> (tokens/s, when learned)
        self._kv_per_token: dict[str, int] = {}  # decode worker -> KV bytes per token (its layout)
        self._push_wait: dict[str, tuple[float, float]] = {}  # prefill worker -> (seconds, when learned)
        self._drain: dict[str, tuple[float, float]] = {}  # worker -> (tokens, busy s) per answer, EWMAs

    # ---------------------------------------------------------------- learning
    def observe_prefill(self, worker_id: str, *, tokens: int, compute_s: float) -> None:
        """A worker computed ``tokens`` prompt tokens in ``compute_s`` (no sample if either is 0)."""
        if tokens <= 0 or compute_s <= 0:
            return
        sample = tokens / compute_s
        now = self.clock()
        seen = worker_id in self._rate
        rate = self.prefill_rate(worker_id, now)
        self._rate[worker_id] = (max(sample, rate) if seen else sample, now)

    def observe_push_wait(self, worker_id: str, seconds: float) -> None:
        """A prefill worker's answer waited ``seconds`` after its prompt was computed for the KV's
        acknowledgement (negative: no sample)."""
        if seconds < 0:
            return
        now = self.clock()
        old = self.push_wait_s(worker_id, now) if worker_id in self._push_wait else None
        a = self.config.push_wait_alpha
        self._push_wait[worker_id] = (seconds if old is None else old + a * (seconds - old), now)

    def observe_answer(self, worker_id: str, tokens: int, busy_s: float) -> None:
        """``worker_id`` answered a prompt of ``tokens`` (as counted in its queue) after ``busy_s`` of
        uninterrupted work since its previous answer, or since it last left idle (no sample if either
        is 0)."""
        if tokens <= 0 or busy_s <= 0:
            return
        got = self._drain.get(worker_id)
        if got is None:
            self._drain[worker_id] = (float(tokens), busy_s)
            return
        a = self.config.drain_alpha
        self._drain[worker_id] = (got[0] + a * (tokens - got[0]), got[1] + a * (busy_s - got[1]))

    def observe_transfer(self, prefill_id: str, decode_id: str, *, bytes_sent: int, seconds: float,
                         blocks_sent: int) -> None:
        self.links.observe(prefill_id, decode_id, bytes_sent=bytes_sent, seconds=seconds,
                           blocks_sent=blocks_sent)

    def set_layout(self, worker_id: str, *, kv_bytes_per_block: int, block_size: int) -> None:
        """The worker's reported KV size (GetStats); 0s leave the prior in place."""
        if kv_bytes_per_block > 0 and block_size > 0:
            self._kv_per_token[worker_id] = max(1, kv_bytes_per_block // block_size)

    def forget(self, worker_id: str) -> None:
        """A worker left or restarted: nothing learnt about its predecessor holds."""
        self._rate.pop(worker_id, None)
        self._kv_per_token.pop(worker_id, None)
        self._push_wait.pop(worker_id, None)
        self._drain.pop(worker_id, None)
        self.links.forget(worker_id)

    # ---------------------------------------------------------------- estimates
    def prefill_rate(self, worker_id: str, now: float | None = None) -> float:
        """Tokens/s: the best recent sample, decaying towards newer ones (the prior until learned)."""
        got = self._rate.get(worker_id)
        if got is None:
            return self.config.prefill_tokens_per_s
        rate, when = got
        age = max((self.clock() if now is None else now) - when, 0.0)
        return rate * math.exp(-self.config.rate_decay_per_s * age)

    def push_wait_s(self, worker_id: str, now: float | None = None) -> float:
        """Seconds a prompt computed on ``worker_id`` now would wait for its KV to be acknowledged, from
        the recent answers (0 until one came), fading with the time since the last one."""
        got = self._push_wait.get(worker_id)
        if got is None:
            return 0.0
        value, when = got
        age = max((self.clock() if now is None else now) - when, 0.0)
        return value * math.exp(-self.config.push_wait_decay_per_s * age)

    def drain_s(self, worker_id: str, tokens_ahead: int) -> float:
        """Seconds until ``tokens_ahead`` already sent to ``worker_id`` are answered, at the rate its
        answers recently came (0 until one did)."""
        got = self._drain.get(worker_id)
        if got is None or tokens_ahead <= 0:
            return 0.0
        return tokens_ahead * got[1] / got[0]

    def learned(self, worker_id: str) -> bool:
        return worker_id in self._rate

    def prefill_s(self, worker_id: str, uncached: int, cached: int = 0) -> float:
        """Seconds ``worker_id`` computes ``uncached`` tokens after ``cached`` ones (attention grows
        with the cached prefix)."""
        if uncached <= 0:
            return 0.0
        return (uncached / self.prefill_rate(worker_id)
                + self.config.attention_s_per_token_pair * uncached * (cached + uncached / 2))

    def queue_s(self, worker_id: str, outstanding_tokens: int, busy_for_s: float = 0.0) -> float:
        """How long a prompt sent now waits behind ``outstanding_tokens`` already sent there, the
        worker having computed the head of that queue for ``busy_for_s`` (the work left is what the
        tokens take minus that; a single server answering in order makes this exact)."""
        if outstanding_tokens <= 0:
            return 0.0
        return max(outstanding_tokens / self.prefill_rate(worker_id) - max(busy_for_s, 0.0), 0.0)

    def tier_load_s(self, worker_id: str, host_blocks: int, disk_blocks: int) -> float:
        """Seconds ``worker_id`` takes to load blocks back from its host and disk KV tiers, at the
        bandwidths a worker assumes before it has measured its own (engine.kv_tiers.cost): the same
        model the worker uses to choose between loading and recomputing."""
        if host_blocks <= 0 and disk_blocks <= 0:
            return 0.0
        per_block = self.kv_bytes_per_token(worker_id) * self.block_size
        return per_block * (host_blocks / TIER_BANDWIDTH["host"] + disk_blocks / TIER_BANDWIDTH["disk"])

    def kv_bytes_per_token(self, decode_id: str) -> int:
        got = self._kv_per_token.get(decode_id)
        if got is not None:
            return got
        learned = self.links.bytes_per_block / self.block_size  # from outcomes, when no report came
        return int(learned) if learned > 0 else self.config.kv_bytes_per_token

    def bandwidth(self, prefill_id: str, decode_id: str) -> float:
        return self.links.bandwidth(prefill_id, decode_id)

    def transfer_s(self, prefill_id: str, decode_id: str, tokens: int) -> float:
        """Seconds to push ``tokens`` tokens of KV from ``prefill_id`` into ``decode_id``."""
        if tokens <= 0:
            return 0.0
        nbytes = tokens * self.kv_bytes_per_token(decode_id)
        return self.config.transfer_latency_s + nbytes / self.bandwidth(prefill_id, decode_id)
