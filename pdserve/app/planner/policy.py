"""The planner's policy: from one window of signals to a target number of replicas per pool, with reasons.

Every window, per pool:

    required = (demand + backlog / drain_horizon) / (capacity per worker x utilisation)

* **prefill**: demand is prompt tokens per second to compute (placed, less prefix-cache hits, plus the
  prompts admission refused, at the window's mean prompt); the backlog is the prompt tokens queued at
  the prefill workers; capacity is what one worker computes per second within the TTFT target.
* **decode**: the largest of three: output tokens per second over a worker's output tokens per second
  within the TPOT target; sequences running plus waiting over the sequences a worker holds within it
  (the waiting ones are its backlog: they need a place in a batch now); KV blocks used over a worker's
  blocks. The reason names the one that binds.

Demand is an exponentially weighted mean of the windows (``demand_half_life_s``) taken at its maximum
with the latest window, so a burst counts at once and a lull fades slowly. Then, from the pool's
current target ``n`` (its replicas at the first window):

* **up** when ``required > n x (1 + band)``: to ``ceil(required)``, at most ``max_step_up`` more,
  unless the pool changed less than ``up_cooldown_s`` ago;
* **down** when ``required <= (n - 1) x (1 - band)`` has held for ``down_cooldown_s`` and the pool has
  not changed for as long: by ``max_step_down`` (never below what keeps ``required`` under the band);
* **idle** (no tokens, queue or running sequence anywhere) for ``down_cooldown_s``: to the minimum;
* always within ``[min, max]`` (a pool outside them moves at once); otherwise it holds.

The band makes the two thresholds a full replica apart, so a target just set does not satisfy the
opposite move; the down cool-down (longer than the up one) is what a square wave shorter than it never
gets past. Scale-down is by drain: an actuator takes a worker out of discovery and lets its requests
finish (``pdserve scale``). The policy reads time only from the ``clock`` it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pdserve.app.planner.capacity import CapacityModel
from pdserve.app.planner.signals import POOLS, Signals


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    ttft_s: float = 2.0  # the SLOs: what capacity is learned under
    tpot_s: float = 0.025
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    utilisation: float = 0.8  # of a worker's capacity the plan fills (the rest absorbs noise)
    band: float = 0.1  # hysteresis: up above n x (1 + band), down below (n - 1) x (1 - band)
    up_cooldown_s: float = 60.0
    down_cooldown_s: float = 300.0
    drain_horizon_s: float | None = None  # a backlog is planned to be gone within this (None: ttft_s)
    demand_half_life_s: float = 60.0
    max_step_up: int = 4
    max_step_down: int = 1

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")

        for name in ("ttft_s", "tpot_s", "demand_half_life_s"):
            positive(name)
        if self.drain_horizon_s is not None:
            positive("drain_horizon_s")
        for pool in POOLS:
            lo, hi = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi and hi >= 1):
                raise ValueError(f"{pool}: need whole numbers 0 <= min <= max and max >= 1, got min {lo!r}, "
                                 f"max {hi!r}")
        if not 0 < self.utilisation <= 1:
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation}")
        if not 0 <= self.band < 1:
            raise ValueError(f"band must be in [0, 1), got {self.band}")
        if not (0 <= self.up_cooldown_s <= self.down_cooldown_s and math.isfinite(self.down_cooldown_s)):
            raise ValueError(f"cool-downs must be finite with 0 <= up <= down, got up {self.up_cooldown_s}, "
                             f"down {self.down_cooldown_s} (scaling down faster than up is what oscillates)")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError(f"step limits must be >= 1, got up {self.max_step_up}, "
                             f"down {self.max_step_down}")

    @property
    def drain_horizon(self) -> float:
        return self.ttft_s if self.drain_horizon_s is None else self.drain_horizon_s

    def bounds(self, pool: str) -> tuple[int, int]:
        return getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")


@dataclass(frozen=True)
class PoolDecision:
    """One pool's decision: ``direction`` up, down or hold; ``inputs`` the numbers behind ``required``."""

    pool: str
    current: int
    target: int
    required: float
    direction: str
    reason: str
    inputs: dict[str, float | str | None] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    """The planner's answer to one window: a decision per pool, and what the capacity model learned."""

    at: float
    pools: tuple[PoolDecision, ...]
    learned: tuple[str, ...] = ()

    def pool(self, name: str) -> PoolDecision:
        return next(p for p in self.pools if p.pool == name)

    def targets(self) -> dict[str, int]:
        return {p.pool: p.target for p in self.pools}

    def changed(self) -> bool:
        return any(p.direction != "hold" for p in self.pools)

    def to_dict(self) -> dict:
        return {"at": self.at, "targets": self.targets(), **{p.pool: p.to_dict() for p in self.pools},
                "learned": list(self.learned)}


class _Demand:
    """An exponentially weighted mean of per-window values with a half-life in seconds; ``level`` is its
    maximum with the latest window (bursts count at once, lulls fade)."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.mean: float | None = None
        self.last = 0.0

    def update(self, x: float, dt: float) -> float:
        if self.mean is None:
            self.mean = x
        else:
            self.mean += (1.0 - 0.5 ** (dt / self.half_life_s)) * (x - self.mean)
        self.last = x
        return self.level

    @property
    def level(self) -> float:
        return max(self.mean or 0.0, self.last)


@dataclass
class _Need:
    required: float
    what: str  # the demand in words, for the reason
    inputs: dict[str, float | str | None]


@dataclass
class _PoolState:
    target: int | None = None
    changed_at: float | None = None
    low_since: float | None = None


class Planner:
    """``observe(signals)`` once per window returns that window's ``Decision`` and remembers the targets
    (its own: in dry-run nothing follows them, and the next window starts from them all the same; an
    actuator that could not follow one says so with ``follow``)."""

    def __init__(self, config: PlannerConfig, capacity: CapacityModel | None = None, *,
                 clock: Callable[[], float]) -> None:
        self.config, self.clock = config, clock
        self.capacity = capacity if capacity is not None else CapacityModel()
        half = config.demand_half_life_s
        self._demand = {k: _Demand(half) for k in ("prompt", "output", "sequences", "kv")}
        self._state = {pool: _PoolState() for pool in POOLS}
        self._idle_since: float | None = None

    # ---------------------------------------------------------------- needs
    def _prefill_need(self, s: Signals) -> _Need:
        c = self.config
        mean_prompt = s.mean_prompt_tokens() or 0.0
        to_compute = max(s.prompt_tokens - s.cached_prompt_tokens, 0.0) + s.refused_requests * mean_prompt
        demand = self._demand["prompt"].update(to_compute / s.window_s, s.window_s)
        backlog_rate = s.backlog_prompt_tokens / c.drain_horizon
        cap = self.capacity.prefill.value
        required = (demand + backlog_rate) / (cap * c.utilisation)
        what = (f"{demand:,.0f} prompt tokens/s + backlog {s.backlog_prompt_tokens:,.0f} / "
                f"{c.drain_horizon:g} s over {cap:,.0f} per worker x {c.utilisation:g}")
        return _Need(required, what, {
            "demand_tokens_per_s": demand, "demand_mean_tokens_per_s": self._demand["prompt"].mean,
            "window_tokens_per_s": to_compute / s.window_s, "backlog_tokens": s.backlog_prompt_tokens,
            "backlog_tokens_per_s": backlog_rate, "capacity_tokens_per_s": cap, "utilisation": c.utilisation,
            "waiting": s.prefill_waiting, "ttft_p90_s": s.ttft_p90_s, "ttft_s": c.ttft_s})

    def _decode_need(self, s: Signals) -> _Need:
        c, m = self.config, self.capacity
        tokens = self._demand["output"].update(s.output_tokens / s.window_s, s.window_s)
        seqs = self._demand["sequences"].update(s.decode_running + s.decode_waiting, s.window_s)
        kv = self._demand["kv"].update(s.kv_blocks_used, s.window_s)
        per_kv = m.kv_blocks_per_worker
        by = {"output tokens/s": tokens / (m.decode_tokens.value * c.utilisation),
              "sequences": seqs / (m.decode_sequences.value * c.utilisation),
              "KV blocks": kv / (per_kv * c.utilisation) if per_kv else 0.0}
        binding = max(by, key=lambda k: by[k])
        words = {"output tokens/s": f"{tokens:,.0f} output tokens/s over {m.decode_tokens.value:,.0f} "
                                    "per worker",
                 "sequences": f"{seqs:,.1f} sequences ({s.decode_waiting:g} waiting) over "
                              f"{m.decode_sequences.value:,.1f} per worker",
                 "KV blocks": f"{kv:,.0f} KV blocks used over {per_kv or 0:,.0f} per worker"}
        return _Need(by[binding], f"{words[binding]} x {c.utilisation:g}", {
            "demand_tokens_per_s": tokens, "demand_mean_tokens_per_s": self._demand["output"].mean,
            "window_tokens_per_s": s.output_tokens / s.window_s,
            "capacity_tokens_per_s": m.decode_tokens.value,
            "sequences": seqs, "waiting": s.decode_waiting, "capacity_sequences": m.decode_sequences.value,
            "kv_blocks_used": kv, "kv_blocks_per_worker": per_kv, "utilisation": c.utilisation,
            "required_by_tokens": by["output tokens/s"], "required_by_sequences": by["sequences"],
            "required_by_kv": by["KV blocks"], "binding": binding, "tpot_p90_s": s.tpot_p90_s,
            "tpot_s": c.tpot_s})

    # ---------------------------------------------------------------- the decision
    def observe(self, s: Signals) -> Decision:
        now = self.clock()
        c = self.config
        learned = self.capacity.learn(s, ttft_s=c.ttft_s, tpot_s=c.tpot_s)
        needs = {"prefill": self._prefill_need(s), "decode": self._decode_need(s)}
        idle = not (s.prompt_tokens or s.output_tokens or s.refused_requests or s.backlog_prompt_tokens
                    or s.prefill_waiting or s.decode_running or s.decode_waiting)
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        pools = tuple(self._decide(pool, needs[pool], s.replicas(pool), now) for pool in POOLS)
        return Decision(at=now, pools=pools, learned=tuple(learned))

    def follow(self, pool: str, replicas: int, *, changed_at: float | None = None) -> None:
        """Start ``pool``'s next decision from ``replicas`` instead of the last target: what an actuator
        calls when the pool has other than the planner decided (a change not applied, a failed scale, a
        resize by hand). ``changed_at``: when the pool's last change really ended (a scale takes time after
        the decision that asked for it); the cool-downs then count from it."""
        st = self._state[pool]
        if st.target != replicas:
            st.target, st.low_since = replicas, None
        if changed_at is not None:
            st.changed_at = changed_at

    def _decide(self, pool: str, need: _Need, observed: int, now: float) -> PoolDecision:
        c, st = self.config, self._state[pool]
        lo, hi = c.bounds(pool)
        n = st.target if st.target is not None else observed
        r = need.required
        since = math.inf if st.changed_at is None else now - st.changed_at
        up_at, down_at = n * (1 + c.band), (n - 1) * (1 - c.band)
        inputs = {**need.inputs, "observed_replicas": observed, "up_above": up_at,
                  "down_below": down_at if n > lo else None}
        target, why = n, ""
        if n < lo or n > hi:
            target = min(max(n, lo), hi)
            why = f"outside [{lo}, {hi}]: to the nearest bound"
        elif r > up_at and n < hi:
            st.low_since = None
            want = min(hi, n + c.max_step_up, max(n + 1, math.ceil(r)))
            if since < c.up_cooldown_s:
                why = (f"needs {r:.2f} (> {up_at:.2f}): {need.what}; would go to {want}, but the last change "
                       f"was {since:.0f} s ago (up cool-down {c.up_cooldown_s:g} s)")
            else:
                target = want
                capped = " (step limit)" if want == n + c.max_step_up and math.ceil(r) > want else ""
                capped = f" (the maximum {hi})" if want == hi and math.ceil(r) > hi else capped
                why = f"needs {r:.2f} (> {up_at:.2f}): {need.what}{capped}"
        elif (idle_for := self._idle_for(now)) is not None and n > lo:
            if idle_for >= c.down_cooldown_s and since >= c.down_cooldown_s:
                target = lo
                why = f"idle for {idle_for:.0f} s: to the minimum"
            else:
                why = f"idle for {idle_for:.0f} s: to the minimum {lo} after {c.down_cooldown_s:g} s"
        elif n > lo and r <= down_at:
            if st.low_since is None:
                st.low_since = now
            low_for = now - st.low_since
            if low_for >= c.down_cooldown_s and since >= c.down_cooldown_s:
                keep = math.ceil(r / (1 - c.band)) if r > 0 else lo
                target = max(lo, n - c.max_step_down, keep)
                why = (f"needs {r:.2f} (<= {down_at:.2f} for {low_for:.0f} s): {need.what}; drain "
                       f"{n - target}")
            else:
                wait = max(c.down_cooldown_s - low_for, c.down_cooldown_s - since)
                why = (f"needs {r:.2f} (<= {down_at:.2f} for {low_for:.0f} s): {need.what}; scale-down in "
                       f"{wait:.0f} s if it stays")
        else:
            st.low_since = None
            if r > up_at:
                why = f"needs {r:.2f}: {need.what}; at the maximum {hi}"
            elif n <= lo and r <= down_at:
                why = f"needs {r:.2f}: {need.what}; at the minimum {lo}"
            else:
                why = f"needs {r:.2f}, within the band ({max(down_at, 0):.2f} .. {up_at:.2f}): {need.what}"
        direction = "up" if target > n else "down" if target < n else "hold"
        if direction != "hold":
            st.changed_at, st.low_since = now, None
            why = f"{direction} {n} -> {target}: {why}"
        else:
            why = f"hold at {n}: {why}"
        st.target = target
        return PoolDecision(pool=pool, current=n, target=target, required=r, direction=direction, reason=why,
                            inputs=inputs)

    def _idle_for(self, now: float) -> float | None:
        return None if self._idle_since is None else now - self._idle_since
