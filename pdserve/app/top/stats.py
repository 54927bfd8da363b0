"""The numbers ``pdserve top`` shows, computed from Prometheus exposition text: no I/O, no terminal.

A ``Scrape`` is one target's samples at one time. Rates are the difference of a counter between two
scrapes of the same target over the time between them (a counter that went down means the process
restarted: the new value is the increase, as PromQL's ``rate`` counts a reset). Percentiles follow
PromQL's ``histogram_quantile(q, sum by (le) (...))``: the buckets summed over every other label, over
the interval's increase of their counts (the cumulative counts when there is no earlier scrape), and
linear interpolation inside the bucket the rank falls in.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

ROUTER_PREFIX = "pdserve_router_"
WORKER_ROLES = ("prefill", "decode", "colocated")

# The router's metrics (router/metrics.py, router/latency.py).
ROUTER_REQUESTS = "pdserve_router_e2e_request_latency_seconds_count"  # requests ended (any outcome)
ROUTER_INFLIGHT = "pdserve_router_inflight_requests"
ROUTER_TTFT = "pdserve_router_time_to_first_token_seconds"
ROUTER_TPOT = "pdserve_router_time_per_output_token_seconds"
ROUTER_KV_BYTES = "pdserve_router_kv_bytes_sent_total"
ROUTER_FAILURES = "pdserve_router_request_failures_total"
# A worker's (pdserve/app/worker_metrics.py).
WORKER_QUEUE = "pdserve_worker_queue_depth"
WORKER_RUNNING = "pdserve_worker_running"
WORKER_FREE_BLOCKS = "pdserve_worker_free_blocks"
WORKER_TOTAL_BLOCKS = "pdserve_worker_total_blocks"
WORKER_PROMPT_TOKENS = "pdserve_worker_prompt_tokens_total"
WORKER_GENERATED_TOKENS = "pdserve_worker_generated_tokens_total"
WORKER_STEP = "pdserve_worker_step_seconds"
WORKER_PREFIX_HITS = "pdserve_worker_prefix_cache_hit_tokens_total"


@dataclass(frozen=True)
class Scrape:
    """One target's samples: ``samples[name]`` lists ``(labels, value)``; ``at`` a monotonic time (s)."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]]

    def total(self, name: str, **match: str) -> float:
        """The sum of ``name``'s samples whose labels include ``match`` (0 when there are none)."""
        return sum(v for labels, v in self.samples.get(name, ()) if _matches(labels, match))

    def value(self, name: str) -> float | None:
        """The sum of ``name``'s samples, None when the target exports none (a gauge not there)."""
        if name not in self.samples:
            return None
        return self.total(name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed by the value of ``label``."""
        out: dict[str, float] = {}
        for labels, v in self.samples.get(name, ()):
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + v
        return out

    def buckets(self, histogram: str) -> dict[float, float]:
        """``sum by (le) (histogram_bucket)``: upper bound -> cumulative count."""
        out: dict[float, float] = {}
        for labels, v in self.samples.get(f"{histogram}_bucket", ()):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + v
        return out


def _matches(labels: dict[str, str], match: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def parse(text: str, at: float) -> Scrape:
    """Prometheus text exposition -> a ``Scrape`` (the official parser; ``ValueError`` on bad text)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return Scrape(at=at, samples=samples)


def identify(scrape: Scrape) -> tuple[str | None, str | None]:
    """``(role, name)`` read from the metrics themselves: the router's names start ``pdserve_router_``;
    a worker's samples carry ``role`` and ``worker`` labels. ``(None, None)`` when neither shows."""
    if any(name.startswith(ROUTER_PREFIX) for name in scrape.samples):
        return "router", "router"
    for name, series in scrape.samples.items():
        if name.startswith("pdserve_worker_"):
            for labels, _ in series:
                if "role" in labels:
                    return labels["role"], labels.get("worker") or None
    return None, None


# --- differences of two scrapes ----------------------------------------------------------------------


def increase(cur: float, prev: float) -> float:
    """A counter's increase from ``prev`` to ``cur``; a smaller ``cur`` means a reset: ``cur`` itself."""
    return cur - prev if cur >= prev else cur


def rate(cur: Scrape, prev: Scrape | None, name: str, **match: str) -> float | None:
    """Per second increase of counter ``name`` between two scrapes; None without an earlier one."""
    if prev is None or cur.at <= prev.at:
        return None
    return increase(cur.total(name, **match), prev.total(name, **match)) / (cur.at - prev.at)


def rates_by_label(cur: Scrape, prev: Scrape | None, name: str, label: str) -> dict[str, float] | None:
    if prev is None or cur.at <= prev.at:
        return None
    before = prev.by_label(name, label)
    dt = cur.at - prev.at
    return {k: increase(v, before.get(k, 0.0)) / dt for k, v in sorted(cur.by_label(name, label).items())}


def bucket_delta(cur: Scrape, prev: Scrape | None, histogram: str) -> dict[float, float]:
    """The interval's bucket counts of ``histogram`` summed over its labels: ``cur - prev`` per bound,
    or ``cur`` itself without an earlier scrape or after a reset (some count went down)."""
    now = cur.buckets(histogram)
    if prev is None:
        return now
    before = prev.buckets(histogram)
    delta = {le: n - before.get(le, 0.0) for le, n in now.items()}
    if any(d < 0 for d in delta.values()):
        return now
    return delta


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's ``histogram_quantile`` over cumulative ``buckets`` (upper bound -> count, ``+Inf`` among
    them); None where PromQL answers NaN (no ``+Inf`` bucket, fewer than two buckets, no observations).

    The rank ``q * count`` falls in the first bucket whose count reaches it; the answer interpolates
    linearly between that bucket's lower bound (the previous bound, 0 for the first bucket) and its upper
    bound; a rank in the ``+Inf`` bucket answers the largest finite bound; a first bucket with an upper
    bound at or below 0 answers that bound. Counts that go down with the bound are raised to the
    previous count (as PromQL forces them monotonic).
    """
    if math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    bounds = sorted(buckets)
    if len(bounds) < 2 or not math.isinf(bounds[-1]):
        return None
    counts, high = [], 0.0
    for le in bounds:
        high = max(high, buckets[le])
        counts.append(high)
    observations = counts[-1]
    if observations <= 0:
        return None
    rank = q * observations
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count <= 0:  # q == 0 on an empty first bucket: PromQL's 0/0
        return None
    return start + (end - start) * (rank / count)


# --- rows --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A metrics address and what is known of it before scraping (from the run directory's targets file)."""

    address: str
    role: str | None = None
    process: str | None = None


@dataclass
class Row:
    """One target in the view. ``up`` False: it did not answer (``error`` says why), the numbers are None.
    ``interval_s`` is the time between the two scrapes the rates and percentiles cover; None: one scrape
    (no rates; percentiles over every observation since the process started)."""

    address: str
    role: str | None
    process: str | None
    up: bool = True
    error: str | None = None
    interval_s: float | None = None


@dataclass
class RouterRow(Row):
    requests: float | None = None  # requests ended since the router started
    requests_per_s: float | None = None
    inflight: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    kv_bytes_per_s: float | None = None
    failures: float | None = None  # since the router started


@dataclass
class WorkerRow(Row):
    queue: float | None = None
    running: float | None = None
    free_blocks: float | None = None
    total_blocks: float | None = None
    kv_used: float | None = None  # 1 - free/total blocks
    prompt_tokens: float | None = None  # computed since the worker started
    generated_tokens: float | None = None
    prompt_tokens_per_s: float | None = None
    generated_tokens_per_s: float | None = None
    step_p50_s: float | None = None
    prefix_hit_tokens: dict[str, float] = field(default_factory=dict)  # by tier, since start
    prefix_hit_tokens_per_s: dict[str, float] | None = None  # by tier


def router_row(target: Target, cur: Scrape, prev: Scrape | None) -> RouterRow:
    ttft = bucket_delta(cur, prev, ROUTER_TTFT)
    tpot = bucket_delta(cur, prev, ROUTER_TPOT)
    return RouterRow(
        address=target.address, role="router", process=target.process or "router",
        interval_s=_interval(cur, prev),
        requests=cur.total(ROUTER_REQUESTS), requests_per_s=rate(cur, prev, ROUTER_REQUESTS),
        inflight=cur.value(ROUTER_INFLIGHT),
        ttft_p50_s=histogram_quantile(0.5, ttft), ttft_p90_s=histogram_quantile(0.9, ttft),
        tpot_p50_s=histogram_quantile(0.5, tpot), tpot_p90_s=histogram_quantile(0.9, tpot),
        kv_bytes_per_s=rate(cur, prev, ROUTER_KV_BYTES), failures=cur.total(ROUTER_FAILURES))


def worker_row(target: Target, cur: Scrape, prev: Scrape | None) -> WorkerRow:
    role, name = identify(cur)
    free, total = cur.value(WORKER_FREE_BLOCKS), cur.value(WORKER_TOTAL_BLOCKS)
    return WorkerRow(
        address=target.address, role=target.role or role, process=target.process or name,
        interval_s=_interval(cur, prev),
        queue=cur.value(WORKER_QUEUE), running=cur.value(WORKER_RUNNING),
        free_blocks=free, total_blocks=total,
        kv_used=(1.0 - free / total) if free is not None and total else None,
        prompt_tokens=cur.total(WORKER_PROMPT_TOKENS), generated_tokens=cur.total(WORKER_GENERATED_TOKENS),
        prompt_tokens_per_s=rate(cur, prev, WORKER_PROMPT_TOKENS),
        generated_tokens_per_s=rate(cur, prev, WORKER_GENERATED_TOKENS),
        step_p50_s=histogram_quantile(0.5, bucket_delta(cur, prev, WORKER_STEP)),
        prefix_hit_tokens=dict(sorted(cur.by_label(WORKER_PREFIX_HITS, "tier").items())),
        prefix_hit_tokens_per_s=rates_by_label(cur, prev, WORKER_PREFIX_HITS, "tier"))


def row(target: Target, cur: Scrape | None, prev: Scrape | None = None, error: str | None = None) -> Row:
    """The row of ``target``: from its scrape ``cur`` (and the earlier ``prev``), or down (``cur`` None)."""
    if cur is None:
        cls = RouterRow if target.role == "router" else WorkerRow if target.role else Row
        return cls(address=target.address, role=target.role, process=target.process, up=False,
                   error=error or "no answer")
    role = target.role or identify(cur)[0]
    if role == "router":
        return router_row(target, cur, prev)
    if role is None:  # it answered, but with no pdserve metrics
        return Row(address=target.address, role=None, process=target.process, error="no pdserve metrics")
    return worker_row(target, cur, prev)


def _interval(cur: Scrape, prev: Scrape | None) -> float | None:
    return cur.at - prev.at if prev is not None and cur.at > prev.at else None


def sort_rows(rows: list[Row]) -> list[Row]:
    """Routers first, then the workers by role (prefill, decode, colocated) and name; unknowns last."""
    order = {"router": 0, **{r: i + 1 for i, r in enumerate(WORKER_ROLES)}}
    return sorted(rows, key=lambda r: (order.get(r.role or "", len(order)), r.process or "", r.address))


def as_json(rows: list[Row]) -> dict:
    """The rows as one JSON-able object (what ``--once --json`` prints)."""
    return {"targets": [{"kind": "router" if isinstance(r, RouterRow) else
                         "worker" if isinstance(r, WorkerRow) else "unknown", **_finite(asdict(r))}
                        for r in rows],
            "up": sum(r.up for r in rows), "down": sum(not r.up for r in rows)}


def _finite(d: dict) -> dict:
    """JSON has no infinities or NaN: such a number becomes None."""
    out = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        elif isinstance(v, dict):
            v = _finite(v)
        out[k] = v
    return out
