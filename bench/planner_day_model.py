"""The day-long planner simulation's inputs: what one GPU serves (from the repo's GPU measurements) and a
seeded day of requests.

**Per-GPU capacity** (``Capacity.measured()``), the llama3-8b shape on one H200, read from
``bench/results/`` so the simulation moves when the measurements do:

* prefill: ``gpu-2xh200-2026-11-21-a9fd28c-roofline.json``, one 4096-token prompt in 107.8 ms (571
  TFLOP/s). A prompt of ``L`` tokens costs its linear FLOPs (the measured count less the causal
  attention term ``4 x layers x heads x head_dim x L (L + 1) / 2``, the formula ``bench/gpu.py`` counts)
  plus its attention FLOPs, at that rate: ~38k tokens/s for short prompts, 7% slower per token at 4k,
  ~25% at 16k. Prompts are computed one after another (FCFS) on a worker.
* decode step: ``step-ahead-h200-2026-11-29-6db83ca.json``, ms per step at batch 1/8/32/64 x context
  1k/4k, steps launched ahead (today's default), least-squares fit ``a + b x batch + c x (tokens of KV
  in the batch)`` (the last term is the HBM read of the KV; the fit is within ~0.4 ms of every point).
* serving overhead on a step: ``frontier-2xh200-2026-11-28-f612cbf-bounded.json``, 1p1d-nixl sweep
  (synchronous steps at that commit): each rate point's mean TPOT over the synchronous fit of the same
  file at the point's batch (Little's law) and mean context; the median ratio (~1.5) multiplies every
  step: router, gRPC and streaming cost per token beyond the engine's step.
* a decode worker holds at most ``max_num_seqs`` = 64 sequences (``pdserve.settings`` default) and
  80 GB of KV (``bench/gpu_disagg.kv_memory_gb`` on an H200: 143 GB x 0.9 less 28 GB, at most 80) in
  2 MiB blocks of 16 tokens (32 layers x K,V x 8 KV heads x 128 x bf16).
* a request's fixed path cost (Allocate + KV wait p50 of the same sweep's lowest rate), added to TTFT.

**The day** (``day_trace``): after a 30-minute warm-up that ramps up from no load, Poisson arrivals at a rate
that follows a night trough (04:00, 12% of the peak) to an afternoon peak (16:00) with an evening shoulder,
multiplicative noise (an AR(1) of 10-minute correlation, 8%) and 2-3 bursts (x1.6-2.2 for 5-15 minutes, a 60 s
ramp up, 120 s down, between 06:00 and 22:00). Three request kinds whose mix changes with the hour: chat
(prompt ~600, answer ~220 tokens: mornings), documents (prompt ~6k, answer ~180: afternoons) and long answers
(prompt ~900, answer ~1.4k: evenings); log-normal lengths within each kind. Everything is drawn from ``seed``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ROOFLINE = "gpu-2xh200-2026-11-21-a9fd28c-roofline.json"
STEP_AHEAD = "step-ahead-h200-2026-11-29-6db83ca.json"
SWEEP = "frontier-2xh200-2026-11-28-f612cbf-bounded.json"
SWEEP_MODE = "1p1d-nixl"
# llama3-8b shape (engine presets): what the attention FLOPs and the KV block size are counted from
LAYERS, HEADS, HEAD_DIM, KV_HEADS, BLOCK = 32, 32, 128, 8, 16
KV_GB_H200 = 80.0  # bench/gpu_disagg.kv_memory_gb on one H200 (its cap)
MAX_NUM_SEQS = 64  # pdserve.settings.WorkerSettings.max_num_seqs default


@dataclass(frozen=True)
class Capacity:
    """One GPU's worth of each pool, and the files it came from."""

    prefill_tflops: float  # effective rate of a prefill, TFLOP/s
    linear_flops_per_token: float
    step_ms: tuple[float, float, float]  # launched ahead: a + b x batch + c x KV tokens in the batch
    serving_factor: float  # serving TPOT over the engine's step at the same batch and context
    max_seqs: int
    kv_blocks: int
    path_overhead_s: float  # Allocate + KV wait, added to every TTFT
    sources: tuple[str, ...]

    def prefill_s(self, tokens: float) -> float:
        attn = 4 * LAYERS * HEADS * HEAD_DIM * tokens * (tokens + 1) / 2
        return (self.linear_flops_per_token * tokens + attn) / (self.prefill_tflops * 1e12)

    def tpot_s(self, batch: float, kv_tokens: float) -> float:
        """Seconds per decode step of ``batch`` sequences holding ``kv_tokens`` of KV, as served."""
        a, b, c = self.step_ms
        return self.serving_factor * (a + b * batch + c * kv_tokens) / 1e3

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def measured(cls, results: Path = RESULTS) -> Capacity:
        roof = json.loads((results / ROOFLINE).read_text())["roofline"]["prefill"]
        n = roof["tokens"]
        attn = 4 * LAYERS * HEADS * HEAD_DIM * n * (n + 1) / 2
        rows = json.loads((results / STEP_AHEAD).read_text())["decode"]
        ahead = _fit([(r["batch"], r["batch"] * r["context"], r["ahead_ms"]) for r in rows])
        sync = _fit([(r["batch"], r["batch"] * r["context"], r["sync_ms"]) for r in rows])
        sweep = json.loads((results / SWEEP).read_text())["results"][SWEEP_MODE]["points"]
        ratios = []
        for p in sweep:
            batch = p["request_throughput"] * (p["e2e_ms"]["mean"] - p["ttft_ms"]["mean"]) / 1e3
            out = p["output_token_throughput"] / p["request_throughput"]
            context = p["kv"]["prompt_tokens"] / p["num_ok"] + out / 2
            ratios.append(p["tpot_ms"]["mean"] / (sync[0] + sync[1] * batch + sync[2] * batch * context))
        low = min(sweep, key=lambda p: p["rate"])["ttft_breakdown_ms"]
        block_bytes = 2 * LAYERS * BLOCK * KV_HEADS * HEAD_DIM * 2
        return cls(prefill_tflops=roof["TFLOPs"], linear_flops_per_token=(roof["flops"] - attn) / n,
                   step_ms=ahead, serving_factor=float(np.median(ratios)),
                   max_seqs=MAX_NUM_SEQS, kv_blocks=int(KV_GB_H200 * 1e9 // block_bytes),
                   path_overhead_s=(low["allocate_ms"]["p50"] + low["kv_wait_ms"]["p50"]) / 1e3,
                   sources=(f"bench/results/{ROOFLINE}", f"bench/results/{STEP_AHEAD}",
                            f"bench/results/{SWEEP} ({SWEEP_MODE})", "bench/gpu_disagg.py (kv_memory_gb)"))


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    x = np.array([[1.0, b, t] for b, t, _ in points])
    y = np.array([ms for _, _, ms in points])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return float(coef[0]), float(coef[1]), float(coef[2])


# --- the day ------------------------------------------------------------------------------------------

# kind -> (prompt median, sigma, min, max), (answer median, sigma, min, max)
KINDS = {"chat": ((600, 0.7, 16, 4096), (220, 0.6, 8, 1024)),
         "document": ((6000, 0.45, 1024, 16384), (180, 0.5, 16, 1024)),
         "long-answer": ((900, 0.5, 64, 4096), (1400, 0.4, 256, 4096))}
# hour -> share of (chat, document, long-answer), interpolated linearly, wrapping at midnight
MIX = [(0, (0.45, 0.15, 0.40)), (4, (0.60, 0.20, 0.20)), (8, (0.80, 0.10, 0.10)), (11, (0.75, 0.15, 0.10)),
       (14, (0.35, 0.55, 0.10)), (17, (0.35, 0.50, 0.15)), (20, (0.35, 0.10, 0.55)), (23, (0.40, 0.10, 0.50))]


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order: ``at`` (s, day from 0; negative in the warm-up), lengths in tokens."""

    at: np.ndarray
    prompt: np.ndarray
    answer: np.ndarray
    kind: np.ndarray  # index into KINDS
    start: float
    end: float  # the day's end (s): no arrival after it
    bursts: tuple[tuple[float, float, float], ...]  # (start s, minutes, factor)

    def __len__(self) -> int:
        return len(self.at)


def mix_at(hours: np.ndarray) -> np.ndarray:
    """Shares of each kind at ``hours`` (rows sum to 1)."""
    xs = [h for h, _ in MIX] + [24 + MIX[0][0]]
    ys = np.array([m for _, m in MIX] + [MIX[0][1]])
    h = np.mod(hours, 24.0)
    return np.stack([np.interp(h, xs, ys[:, k]) for k in range(ys.shape[1])], axis=1)


def diurnal(hours: np.ndarray) -> np.ndarray:
    """The rate's shape, 0..~1: a trough at 04:00, the peak at 16:00, a shoulder around 20:30."""
    h = np.mod(hours, 24.0)
    base = 0.5 * (1 - np.cos(2 * np.pi * (h - 4) / 24))
    shoulder = 0.25 * np.exp(-0.5 * ((h - 20.5) / 1.5) ** 2)
    return 0.12 + 0.88 * np.minimum(base + shoulder, 1.0)


def day_trace(seed: int, *, hours: float = 24.0, peak_rps: float = 30.0, warmup_s: float = 1800.0) -> Trace:
    rng = np.random.default_rng(seed)
    start = -warmup_s
    secs = np.arange(start, hours * 3600.0)
    # the warm-up ramps from nothing, so every policy meets midnight in a state its own rules led to
    rate = peak_rps * diurnal(secs / 3600.0) * np.clip((secs - start) / max(warmup_s, 1.0), 0.0, 1.0)
    # noise: AR(1) on a 60 s grid, 10-minute correlation, 8% stationary deviation, held within a minute
    steps = len(secs) // 60 + 1
    phi = math.exp(-60.0 / 600.0)
    eps = rng.normal(0.0, 0.08 * math.sqrt(1 - phi * phi), steps)
    noise = np.empty(steps)
    noise[0] = rng.normal(0.0, 0.08)
    for i in range(1, steps):
        noise[i] = phi * noise[i - 1] + eps[i]
    rate *= np.exp(noise[((secs - start) // 60).astype(int)])
    bursts = []
    lo = hours * 900.0  # from a quarter into the trace (06:00 in a day) to 22:00 or 20 minutes before its end
    hi = max(min(22 * 3600.0, hours * 3600.0 - 1200.0), lo)
    for _ in range(2 + int(rng.integers(0, 2))):
        t0 = float(rng.uniform(lo, hi))
        minutes, factor = float(rng.uniform(5, 15)), float(rng.uniform(1.6, 2.2))
        end = t0 + minutes * 60
        up = np.clip((secs - t0) / 60.0, 0, 1)
        down = np.clip(1 - (secs - end) / 120.0, 0, 1)
        rate *= 1 + (factor - 1) * np.minimum(up, down)
        bursts.append((t0, minutes, factor))
    counts = rng.poisson(rate)
    at = np.repeat(secs, counts) + rng.random(int(counts.sum()))
    at.sort()
    shares = mix_at(at / 3600.0)
    kind = (rng.random(len(at))[:, None] > np.cumsum(shares, axis=1)).sum(axis=1)
    kind = np.minimum(kind, len(KINDS) - 1)
    prompt = np.empty(len(at), dtype=np.int64)
    answer = np.empty(len(at), dtype=np.int64)
    for k, (p, a) in enumerate(KINDS.values()):
        idx = np.flatnonzero(kind == k)
        prompt[idx] = _lognormal(rng, p, len(idx))
        answer[idx] = _lognormal(rng, a, len(idx))
    return Trace(at=at, prompt=prompt, answer=answer, kind=kind, start=start, end=hours * 3600.0,
                 bursts=tuple(sorted(bursts)))


def _lognormal(rng: np.random.Generator, spec: tuple[float, float, float, float], n: int) -> np.ndarray:
    median, sigma, lo, hi = spec
    return np.clip(np.round(median * np.exp(rng.normal(0.0, sigma, n))), lo, hi).astype(np.int64)
