"""Latency statistics of a benchmark run: percentiles, throughput and goodput.

Definitions (per request): TTFT = first token arrival - send; ITL = gaps between consecutive token
arrivals; TPOT = (last token - first token) / (output tokens - 1); E2E = last message - send.
Goodput counts requests per second that finished OK *and* met every given SLO (TTFT, TPOT); SLO
attainment is the share of all requests sent that did (RESOURCE_EXHAUSTED sheds count as misses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return float("nan")
    k = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


@dataclass(kw_only=True)
class Sample:
    ok: bool
    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    tpot_s: float = float("nan")
    e2e_s: float = float("nan")
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    session: str = ""
    turn: int = 0                               # 0-based turn of its session (0 for single requests)
    final: dict = field(default_factory=dict)   # the response's FinalInfo (pdserve.client dict form)
    reusable_tokens: int = 0                    # a session's turn: the conversation before its new tokens
    retry_after_ms: float | None = None         # a refused request: the router's retry hint


def summarize(samples: Sequence[Sample], duration_s: float, *, ttft_slo_ms: float | None = None,
              tpot_slo_ms: float | None = None, block_size: int = 16) -> dict:
    ok = [s for s in samples if s.ok]
    out: dict = {"num_requests": len(samples), "num_ok": len(ok), "num_errors": len(samples) - len(ok),
                 "duration_s": duration_s}
    series = {"ttft_ms": [s.ttft_s * 1e3 for s in ok], "itl_ms": [g * 1e3 for s in ok for g in s.itl_s],
              "tpot_ms": [s.tpot_s * 1e3 for s in ok], "e2e_ms": [s.e2e_s * 1e3 for s in ok]}
    for name, vals in series.items():
        clean = [v for v in vals if not math.isnan(v)]
        out[name] = {"mean": sum(clean) / len(clean) if clean else float("nan"),
                     **{f"p{q}": percentile(clean, q) for q in (50, 90, 99)}}
    dur = max(duration_s, 1e-9)
    out_tokens = sum(s.output_tokens for s in ok)
    out["request_throughput"] = len(ok) / dur
    out["output_token_throughput"] = out_tokens / dur
    out["total_token_throughput"] = (out_tokens + sum(s.prompt_tokens for s in ok)) / dur

    def good(s: Sample) -> bool:
        if ttft_slo_ms is not None and not s.ttft_s * 1e3 <= ttft_slo_ms:
            return False
        return not (tpot_slo_ms is not None and s.output_tokens > 1 and not s.tpot_s * 1e3 <= tpot_slo_ms)

    # num_good: requests within both SLOs. Two runs of the same prompts that both serve every request
    # within them have equal num_good; their goodput (num_good / duration) still differs by how long
    # each took to drain its last request.
    out["num_good"] = sum(1 for s in ok if good(s))
    out["goodput"] = out["num_good"] / dur
    # SLO attainment: of every request sent, the share served within the SLOs (a refused or failed
    # request is a miss); the sweep's goodput frontier is the highest rate where it stays >= 95%.
    out["slo_attainment"] = out["num_good"] / len(samples) if samples else float("nan")
    hints = [s.retry_after_ms for s in samples if s.retry_after_ms is not None]
    out["retry_after_ms_p50"] = percentile(hints, 50)
    out["slo"] = {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms}
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.error] = errors.get(s.error, 0) + 1
    out["errors"] = errors
    out["kv"] = kv_summary(ok, block_size)
    out["ttft_breakdown_ms"] = ttft_breakdown(ok)
    if any(s.turn for s in ok):
        out["returning_turns"] = returning_turns(ok, block_size)
    return out


def returning_turns(ok: Sequence[Sample], block_size: int = 16) -> dict:
    """The turns of sessions after their first, which could reuse their conversation's KV.

    Reuse of a turn: the prompt tokens it did not compute, where its prompt was computed (the prefill
    worker's cache for a remote prefill; the decode worker's for a local one), of its reusable tokens;
    ``from_tiers`` the share of those loaded back from a host or disk tier, ``device_only`` the share a
    device cache alone served. ``prefill_tokens`` are the prompt tokens computed per returning turn."""
    turns = [s for s in ok if s.turn > 0]
    reusable = sum(s.reusable_tokens for s in turns)
    served = tiered = computed = 0
    for s in turns:
        f = s.final
        if f.get("prefill_mode") == "local":
            cached, tier = int(f.get("kv_blocks_reused", 0)) * block_size, int(f.get("decode_tier_tokens", 0))
        else:
            cached, tier = int(f.get("prefill_cached_tokens", 0)), int(f.get("prefill_tier_tokens", 0))
        got = min(cached, s.reusable_tokens)
        served += got
        tiered += min(tier, got)
        computed += s.prompt_tokens - cached
    ttft = [s.ttft_s * 1e3 for s in turns]
    tpot = [s.tpot_s * 1e3 for s in turns if not math.isnan(s.tpot_s)]
    n = len(turns)
    return {"turns": n, "reusable_tokens": reusable,
            "reuse_share": served / reusable if reusable else float("nan"),
            "reuse_share_device_only": (served - tiered) / reusable if reusable else float("nan"),
            "reuse_share_from_tiers": tiered / reusable if reusable else float("nan"),
            "prefill_tokens_per_turn": computed / n if n else float("nan"),
            "ttft_ms": {f"p{q}": percentile(ttft, q) for q in (50, 90)},
            "tpot_ms": {f"p{q}": percentile(tpot, q) for q in (50, 90)},
            "decode_tier_tokens": sum(int(s.final.get("decode_tier_tokens", 0)) for s in turns),
            "prefill_tier_tokens": sum(int(s.final.get("prefill_tier_tokens", 0)) for s in turns)}


TTFT_STAGES = ("allocate_ms", "prefill_rpc_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_wait_ms",
               "admission_wait_est_ms")


def ttft_breakdown(ok: Sequence[Sample]) -> dict:
    """p50/p90 of each stage of the time to the first token (FinalInfo) over the remotely prefilled
    requests: where a disaggregated TTFT goes (decode Allocate, the Prefill call, and inside it the
    prefill worker's engine queue, compute, KV acknowledgement wait), beside the router's admission
    estimate of each one's wait to start. Empty without such requests."""
    remote = [s.final for s in ok if s.final.get("prefill_mode", "remote") == "remote"
              and s.final.get("prefill_rpc_ms")]
    if not remote:
        return {}
    out: dict = {"requests": len(remote)}
    for key in TTFT_STAGES:
        vals = [float(f.get(key, 0.0)) for f in remote]
        out[key] = {f"p{q}": percentile(vals, q) for q in (50, 90)}
    return out


def kv_summary(ok: Sequence[Sample], block_size: int = 16) -> dict:
    """KV traffic and prompt-cache reuse of the successful requests, from their final metadata.

    ``no_reuse_*``: what would move if every prompt block were shipped on every turn (no decode-side
    cache). Hit ratios are prompt tokens served from a cache / prompt tokens: decode side (blocks
    not shipped) and prefill side (tokens not recomputed)."""
    prompt = sum(s.prompt_tokens for s in ok)
    sent = sum(int(s.final.get("kv_blocks_sent", 0)) for s in ok)
    nbytes = sum(int(s.final.get("kv_bytes_sent", 0)) for s in ok)
    reused = sum(int(s.final.get("kv_blocks_reused", 0)) for s in ok)
    prefill_cached = sum(int(s.final.get("prefill_cached_tokens", 0)) for s in ok)
    no_reuse_blocks = sum(-(-s.prompt_tokens // block_size) for s in ok)
    per_block = nbytes / sent if sent else 0.0
    per_worker: dict[str, int] = {}
    for s in ok:
        w = s.final.get("decode_worker", "")
        if w:
            per_worker[w] = per_worker.get(w, 0) + 1
    counts = list(per_worker.values())
    mean = sum(counts) / len(counts) if counts else 0.0
    return {"prompt_tokens": prompt, "kv_blocks_sent": sent, "kv_bytes_sent": nbytes,
            "kv_blocks_reused": reused, "no_reuse_blocks": no_reuse_blocks,
            "no_reuse_bytes": no_reuse_blocks * per_block,
            "bytes_vs_no_reuse": sent / no_reuse_blocks if no_reuse_blocks else float("nan"),
            "decode_hit_ratio": reused * block_size / prompt if prompt else float("nan"),
            "prefill_hit_ratio": prefill_cached / prompt if prompt else float("nan"),
            "session_hits": sum(1 for s in ok if s.final.get("session_hit")),
            "session_moves": sum(1 for s in ok if s.final.get("session_moved")),
            "requests_per_decode_worker": dict(sorted(per_worker.items())),
            "decode_max_over_mean": max(counts) / mean if counts and mean else float("nan")}


def format_table(summary: dict, title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"requests {summary['num_ok']}/{summary['num_requests']} ok "
                 f"in {summary['duration_s']:.2f}s   "
                 f"{summary['request_throughput']:.2f} req/s   "
                 f"{summary['output_token_throughput']:.1f} out tok/s   "
                 f"goodput {summary['goodput']:.2f} req/s")
    lines.append(f"{'metric':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        m = summary[name]
        lines.append(f"{name:<10}" + "".join(f"{m[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99")))
    kv = summary.get("kv")
    if kv and kv["prompt_tokens"]:
        lines.append(f"kv: {kv['kv_blocks_sent']} blocks / {kv['kv_bytes_sent']} B sent "
                     f"({kv['bytes_vs_no_reuse']:.1%} of no-reuse), prompt-cache hit ratio decode "
                     f"{kv['decode_hit_ratio']:.1%} prefill {kv['prefill_hit_ratio']:.1%}, "
                     f"requests per decode worker {kv['requests_per_decode_worker']} "
                     f"(max/mean {kv['decode_max_over_mean']:.2f}), session moves {kv['session_moves']}")
    if summary["errors"]:
        lines.append(f"errors: {summary['errors']}")
    return "\n".join(lines)
