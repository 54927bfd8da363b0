"""One observation window of a cluster as the planner sees it, and how it is read from Prometheus.

A ``Signals`` is what happened between two scrapes of every process (the router and each worker): the
work that arrived and was done (counter increases), the state at the window's end (gauges), the SLO
percentiles over the window (the router's histograms' bucket increases, PromQL's rule:
``pdserve/app/top/stats.py``) and how many workers of each pool answered. The planner's recorded traces
are ``Signals`` as JSON lines (``to_dict`` / ``from_dict``), so a live run and a replay read the same.

Where each field comes from (``from_scrapes``):

* router: ``prompt_tokens`` from ``pdserve_router_prompt_tokens_total`` (the prompts placed),
  ``cached_prompt_tokens`` from ``pdserve_router_cache_hit_tokens_total{pool="prefill"}``, ``requests``
  from ``pdserve_router_placements_total{pool="decode"}`` (one per placed request), ``refused_requests``
  from ``pdserve_router_admission_refused_total`` (demand turned away), ``ttft_p90_s`` and
  ``tpot_p90_s`` from ``pdserve_router_time_to_first_token_seconds`` and
  ``pdserve_router_time_per_output_token_seconds``, and its ``pdserve_router_allocate_queue_waiting``
  (Allocates waiting for blocks) into ``decode_waiting``;
* prefill workers: ``prefill_computed_tokens`` from ``pdserve_worker_prompt_tokens_total``,
  ``prefill_waiting`` from ``pdserve_worker_queue_depth``; ``backlog_prompt_tokens`` is
  ``prefill_waiting`` x the mean prompt of a placed request (the window's, else since the router
  started): an estimate, as no process exports the queued tokens themselves;
* decode workers: ``output_tokens`` from ``pdserve_worker_generated_tokens_total``, ``decode_running``
  from ``pdserve_worker_running``, their ``pdserve_worker_queue_depth`` into ``decode_waiting``,
  ``kv_blocks_total`` from ``pdserve_worker_total_blocks`` and ``kv_blocks_used`` as that less
  ``pdserve_worker_free_blocks``;
* ``prefill_replicas``, ``decode_replicas``: the worker targets of that role that answered.

Counters count only for a target scraped both times (a target new in this scrape, or back after a gap,
starts its next window: its counters since it started are not this window's work); gauges count for
every target that answered. Colocated workers belong to neither pool and are left out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pdserve.app.top.stats import Scrape, bucket_delta, histogram_quantile, identify, increase

POOLS = ("prefill", "decode")

ROUTER_PROMPT_TOKENS = "pdserve_router_prompt_tokens_total"
ROUTER_CACHE_HITS = "pdserve_router_cache_hit_tokens_total"
ROUTER_PLACEMENTS = "pdserve_router_placements_total"
ROUTER_REFUSED = "pdserve_router_admission_refused_total"
ROUTER_ALLOCATE_WAITING = "pdserve_router_allocate_queue_waiting"
ROUTER_TTFT = "pdserve_router_time_to_first_token_seconds"
ROUTER_TPOT = "pdserve_router_time_per_output_token_seconds"
WORKER_PROMPT_TOKENS = "pdserve_worker_prompt_tokens_total"
WORKER_GENERATED_TOKENS = "pdserve_worker_generated_tokens_total"
WORKER_QUEUE = "pdserve_worker_queue_depth"
WORKER_RUNNING = "pdserve_worker_running"
WORKER_FREE_BLOCKS = "pdserve_worker_free_blocks"
WORKER_TOTAL_BLOCKS = "pdserve_worker_total_blocks"


@dataclass(frozen=True, kw_only=True)
class Signals:
    """One window: ``at`` its end (seconds, any clock), ``window_s`` its length. Token and request
    fields are counts over the window; ``*_waiting``, ``*_running``, ``kv_*`` and the backlog are the
    state at its end; the percentiles are over the requests that ended in it (None: none did)."""

    at: float
    window_s: float
    prompt_tokens: float = 0.0
    cached_prompt_tokens: float = 0.0
    requests: float = 0.0
    refused_requests: float = 0.0
    prefill_computed_tokens: float = 0.0
    output_tokens: float = 0.0
    backlog_prompt_tokens: float = 0.0
    prefill_waiting: float = 0.0
    decode_running: float = 0.0
    decode_waiting: float = 0.0
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    prefill_replicas: int = 0
    decode_replicas: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at) and math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"a window needs a finite time and a length > 0, got at={self.at}, "
                             f"window_s={self.window_s}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("at", "window_s") or v is None:
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("prefill_replicas", "decode_replicas"):
            if int(getattr(self, name)) != getattr(self, name):
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}")

    def replicas(self, pool: str) -> int:
        return int(self.prefill_replicas if pool == "prefill" else self.decode_replicas)

    def mean_prompt_tokens(self) -> float | None:
        """Tokens of the mean prompt placed in the window (None: none was placed)."""
        return self.prompt_tokens / self.requests if self.requests > 0 else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Signals:
        """The inverse of ``to_dict``; an unknown key is an error (a misspelt field is not a zero)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown signal fields {unknown} (known: {', '.join(sorted(known))})")
        missing = [k for k in ("at", "window_s") if k not in data]
        if missing:
            raise ValueError(f"a window needs {missing}")
        return cls(**dict(data))


def load_trace(path: str | Path) -> list[Signals]:
    """A recorded trace: one ``Signals.to_dict()`` JSON object per line (blank and ``#`` lines skipped),
    in time order. ``ValueError`` names the line of anything else."""
    out: list[Signals] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            s = Signals.from_dict(json.loads(line))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
        if out and s.at <= out[-1].at:
            raise ValueError(f"{path}:{n}: windows must go forward in time ({s.at} after {out[-1].at})")
        out.append(s)
    return out


# --- from two scrapes --------------------------------------------------------------------------------


def _role(address: str, scrape: Scrape, roles: Mapping[str, str]) -> str | None:
    return roles.get(address) or identify(scrape)[0]


def from_scrapes(prev: Mapping[str, Scrape], cur: Mapping[str, Scrape],
                 roles: Mapping[str, str] | None = None) -> Signals:
    """The window between two scrapes of a cluster, each keyed by target address. ``roles`` gives the
    role of an address where its targets file says it (else it is read from the metrics). The window
    ends at the latest scrape and lasts as long as the router's interval (the mean of the targets'
    where there is no router). ``ValueError`` when no target was scraped twice."""
    roles = roles or {}
    both = [a for a in cur if a in prev and cur[a].at > prev[a].at]
    if not both:
        raise ValueError("no target was scraped twice: a window needs two scrapes of one process")
    routers = [a for a in both if _role(a, cur[a], roles) == "router"]
    spans = [cur[a].at - prev[a].at for a in (routers or both)]
    window = sum(spans) / len(spans)
    at = max(s.at for s in cur.values())

    def grew(address: str, name: str, **match: str) -> float:
        return increase(cur[address].total(name, **match), prev[address].total(name, **match))

    counts = dict.fromkeys(("prompt_tokens", "cached_prompt_tokens", "requests", "refused_requests",
                            "prefill_computed_tokens", "output_tokens"), 0.0)
    placed_prompt = placed = 0.0  # since the routers started: the mean prompt without a window's own
    ttft: dict[float, float] = {}
    tpot: dict[float, float] = {}
    for a in routers:
        counts["prompt_tokens"] += grew(a, ROUTER_PROMPT_TOKENS)
        counts["cached_prompt_tokens"] += grew(a, ROUTER_CACHE_HITS, pool="prefill")
        counts["requests"] += grew(a, ROUTER_PLACEMENTS, pool="decode")
        counts["refused_requests"] += grew(a, ROUTER_REFUSED)
        placed_prompt += cur[a].total(ROUTER_PROMPT_TOKENS)
        placed += cur[a].total(ROUTER_PLACEMENTS, pool="decode")
        for into, name in ((ttft, ROUTER_TTFT), (tpot, ROUTER_TPOT)):
            for le, n in bucket_delta(cur[a], prev[a], name).items():
                into[le] = into.get(le, 0.0) + n
    for a in both:
        role = _role(a, cur[a], roles)
        if role == "prefill":
            counts["prefill_computed_tokens"] += grew(a, WORKER_PROMPT_TOKENS)
        elif role == "decode":
            counts["output_tokens"] += grew(a, WORKER_GENERATED_TOKENS)

    gauges = dict.fromkeys(("prefill_waiting", "decode_running", "decode_waiting", "kv_blocks_used",
                            "kv_blocks_total"), 0.0)
    replicas = {"prefill": 0, "decode": 0}
    for a, s in cur.items():
        role = _role(a, s, roles)
        if role == "router":
            gauges["decode_waiting"] += s.total(ROUTER_ALLOCATE_WAITING)
        elif role == "prefill":
            replicas["prefill"] += 1
            gauges["prefill_waiting"] += s.total(WORKER_QUEUE)
        elif role == "decode":
            replicas["decode"] += 1
            total = s.total(WORKER_TOTAL_BLOCKS)
            gauges["decode_running"] += s.total(WORKER_RUNNING)
            gauges["decode_waiting"] += s.total(WORKER_QUEUE)
            gauges["kv_blocks_total"] += total
            gauges["kv_blocks_used"] += max(total - s.total(WORKER_FREE_BLOCKS), 0.0)

    if counts["requests"] > 0:
        mean_prompt = counts["prompt_tokens"] / counts["requests"]
    else:
        mean_prompt = placed_prompt / placed if placed > 0 else 0.0
    return Signals(at=at, window_s=window, **counts, **gauges,
                   backlog_prompt_tokens=gauges["prefill_waiting"] * mean_prompt,
                   ttft_p90_s=histogram_quantile(0.9, ttft), tpot_p90_s=histogram_quantile(0.9, tpot),
                   prefill_replicas=replicas["prefill"], decode_replicas=replicas["decode"])
