"""What one worker of each pool serves within the SLOs: the planner's capacity model, learned online.

Three estimates, per worker:

* prefill: prompt tokens per second computed while the TTFT target holds;
* decode: output tokens per second, and sequences in the batch at once, while the TPOT target holds;

and the decode workers' KV blocks, measured (the pool's total blocks over its workers), not learned.

Each estimate starts from a seed, the built-in constants (a guess, labelled so) or a ``pdserve bench
--sweep`` profile (``seed_from_sweep``: what the swept cluster served at its SLO-goodput rate, the
highest rate whose SLO attainment reached the sweep's target), and moves by an exponentially weighted
step toward what a window shows:

* the pool met its SLO while **saturated** (requests waiting at both ends of the window, so its
  workers had work throughout): the window's per-worker rate is what a worker sustains: step toward it;
* it met its SLO doing **more** per worker than the estimate: the estimate was low: step up;
* it missed its SLO while **loaded** (saturated, or doing at least 90% of the estimate; for decode also
  any window with sequences running, as a step's time is set by the batch it runs) doing **less** than
  the estimate: the estimate was high: step down;
* anything else (light load within the SLO, no percentile in the window, a miss at light load)
  teaches nothing: a worker doing a little within the SLO says nothing of how much it could do.

An estimate never falls below a tenth of its seed, so a stalled pool (no tokens while its queue grows)
cannot talk the planner into its maximum on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.app.planner.signals import Signals

BUSY_SHARE = 0.9  # a worker doing this share of the estimate counts as busy
FLOOR_SHARE = 0.1  # an estimate stays at or above this share of its seed


@dataclass(frozen=True, kw_only=True)
class Seed:
    """Per-worker capacities to start from, and where they came from (shown by ``planner explain``)."""

    prefill_tokens_per_s: float = 4000.0
    decode_tokens_per_s: float = 800.0
    decode_sequences: float = 32.0
    source: str = "built-in guess (no profile)"

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_sequences"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v}")


@dataclass
class Estimate:
    """One learned capacity: ``value`` per worker in ``unit``; ``samples`` windows it learned from."""

    unit: str
    value: float
    seed: float
    source: str
    samples: int = 0

    def learn(self, observed: float, *, met: bool, saturated: bool, loaded: bool, alpha: float) -> bool:
        """Move toward ``observed`` (per worker) by the rules of the module doc; True when it moved."""
        if not math.isfinite(observed) or observed < 0:
            return False
        if met:
            toward = observed > self.value or saturated
        else:
            toward = observed < self.value and (saturated or loaded)
        if not toward:
            return False
        self.value = max(self.value + alpha * (observed - self.value), self.seed * FLOOR_SHARE)
        self.samples += 1
        return True


@dataclass
class CapacityModel:
    """The per-worker capacities the planner divides demand by (``alpha``: the weight of a new window)."""

    seed: Seed = field(default_factory=Seed)
    alpha: float = 0.3
    prefill: Estimate = field(init=False)
    decode_tokens: Estimate = field(init=False)
    decode_sequences: Estimate = field(init=False)
    kv_blocks_per_worker: float | None = None  # measured: decode blocks over decode workers
    # requests waiting at the last window's end, per pool
    _waiting: dict[str, bool] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        s = self.seed
        self.prefill = Estimate("prompt tokens/s", s.prefill_tokens_per_s, s.prefill_tokens_per_s, s.source)
        self.decode_tokens = Estimate("output tokens/s", s.decode_tokens_per_s, s.decode_tokens_per_s,
                                      s.source)
        self.decode_sequences = Estimate("sequences", s.decode_sequences, s.decode_sequences, s.source)

    def learn(self, s: Signals, *, ttft_s: float, tpot_s: float) -> list[str]:
        """Learn from one window; returns what moved, in words (for the decision's log)."""
        moved: list[str] = []
        n_p, n_d = s.prefill_replicas, s.decode_replicas
        if n_d and s.kv_blocks_total:
            self.kv_blocks_per_worker = s.kv_blocks_total / n_d
        queued = {"prefill": self._queued("prefill", s.prefill_waiting > 0),
                  "decode": self._queued("decode", s.decode_waiting > 0)}
        if n_p and s.ttft_p90_s is not None:
            per_worker = s.prefill_computed_tokens / s.window_s / n_p
            loaded = per_worker >= BUSY_SHARE * self.prefill.value
            moved += self._learn("prefill", self.prefill, per_worker, s.ttft_p90_s <= ttft_s,
                                 queued["prefill"], loaded)
        if n_d and s.tpot_p90_s is not None:
            tokens = s.output_tokens / s.window_s / n_d
            seqs = s.decode_running / n_d
            met = s.tpot_p90_s <= tpot_s
            moved += self._learn("decode", self.decode_tokens, tokens, met, queued["decode"],
                                 tokens >= BUSY_SHARE * self.decode_tokens.value or seqs > 0)
            moved += self._learn("decode", self.decode_sequences, seqs, met, queued["decode"], seqs > 0)
        return moved

    def _queued(self, pool: str, now: bool) -> bool:
        """Requests waiting at this window's end and at the one before's (the whole window had work)."""
        before, self._waiting[pool] = self._waiting.get(pool, False), now
        return before and now

    def _learn(self, pool: str, est: Estimate, observed: float, met: bool, saturated: bool,
               loaded: bool) -> list[str]:
        before = est.value
        if not est.learn(observed, met=met, saturated=saturated, loaded=loaded, alpha=self.alpha):
            return []
        est.source = "learned"
        why = f"SLO {'met' if met else 'missed'}{', saturated' if saturated else ''}"
        return [f"{pool} {est.unit} per worker {before:,.1f} -> {est.value:,.1f} (window: {observed:,.1f}, "
                f"{why})"]

    def to_dict(self) -> dict:
        return {"prefill_tokens_per_s": asdict(self.prefill),
                "decode_tokens_per_s": asdict(self.decode_tokens),
                "decode_sequences": asdict(self.decode_sequences),
                "kv_blocks_per_worker": self.kv_blocks_per_worker, "alpha": self.alpha}


# --- seeds from a sweep ------------------------------------------------------------------------------


def _pool_sizes(name: str, point: dict) -> tuple[int, int] | None:
    """(prefill, decode) workers of the swept cluster: counted from the point's per-process CPU report
    (``loadgen/cpu.py``) when it has one, else read from a ``pdserve bench --modes`` name."""
    roles = [p.get("role") for p in (point.get("cpu") or {}).get("processes", {}).values()]
    if roles.count("prefill") and roles.count("decode"):
        return roles.count("prefill"), roles.count("decode")
    mode = name.partition("@")[0]
    if mode.startswith("1p1d") or mode == "conditional":
        return 1, 1
    return None


def seed_from_sweep(data: dict, *, mode: str | None = None, prefill_workers: int | None = None,
                    decode_workers: int | None = None, label: str = "profile") -> Seed:
    """Per-worker seeds from a ``pdserve bench --sweep --json`` result: at the SLO-goodput point of
    ``mode`` (the only one when the file has one), the prompt tokens computed per second over its
    prefill workers, the output tokens per second over its decode workers, and the sequences a decode
    worker held at once (Little's law: requests/s x the mean time from first to last token). The sweep
    met its SLOs there, so these are what a worker is known to sustain (the frontier lies between that
    rate and the next). Pool sizes come from the point's CPU report or the mode's name; pass them for a
    ``--router`` sweep of a larger cluster. ``ValueError`` says what is missing."""
    results = data.get("results")
    if not isinstance(results, dict) or not results:
        raise ValueError("not a `pdserve bench --sweep --json` file: no \"results\"")
    if mode is None:
        if len(results) != 1:
            raise ValueError(f"the profile holds {', '.join(results)}: choose one with --profile-mode")
        mode = next(iter(results))
    if mode not in results:
        raise ValueError(f"the profile has no mode {mode!r} (it has {', '.join(results)})")
    res = results[mode]
    points = res.get("points") or []
    target = float(res.get("target", 0.95))
    good = [p for p in points if p.get("slo_attainment", 0.0) >= target]
    if not good:
        raise ValueError(f"{mode}: no swept rate met the SLOs for {target:.0%} of requests: nothing to seed")
    point = max(good, key=lambda p: p["rate"])
    sizes = _pool_sizes(mode, point)
    n_p = prefill_workers or (sizes[0] if sizes else None)
    n_d = decode_workers or (sizes[1] if sizes else None)
    if not n_p or not n_d:
        raise ValueError(f"{mode}: cannot tell the swept cluster's pool sizes (a colocated mode has no "
                         "prefill pool); give --profile-prefill N --profile-decode N")
    duration = float(point["duration_s"])
    kv = point.get("kv") or {}
    hit = kv.get("prefill_hit_ratio", 0.0)
    hit = hit if isinstance(hit, (int, float)) and math.isfinite(hit) else 0.0
    prompt_per_s = float(kv.get("prompt_tokens", 0)) * (1.0 - hit) / duration
    output_per_s = float(point["output_token_throughput"])
    decode_s = (point["e2e_ms"]["mean"] - point["ttft_ms"]["mean"]) / 1e3
    sequences = float(point["request_throughput"]) * decode_s if math.isfinite(decode_s) else 0.0
    if not (prompt_per_s > 0 and output_per_s > 0):
        raise ValueError(f"{mode} @ {point['rate']:g} req/s: no prompt or output tokens to learn from")
    slo = res.get("slo") or {}
    return Seed(prefill_tokens_per_s=prompt_per_s / n_p, decode_tokens_per_s=output_per_s / n_d,
                decode_sequences=max(sequences / n_d, 1.0),
                source=f"{label}: {mode} @ {point['rate']:g} req/s ({point['slo_attainment']:.0%} within "
                       f"TTFT {slo.get('ttft_ms', '?')} ms / TPOT {slo.get('tpot_ms', '?')} ms), "
                       f"{n_p} prefill + {n_d} decode")


def load_sweep(path: str | Path, **kw) -> Seed:
    """``seed_from_sweep`` of a JSON file (``kw`` as there)."""
    return seed_from_sweep(json.loads(Path(path).read_text()), label=Path(path).name, **kw)
