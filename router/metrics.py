"""Prometheus metrics of the router's placement and shared state.

One ``RouterMetrics`` per router process, on its own ``CollectorRegistry`` (tests and several
Placers in one process never collide on the global registry). The router exposes it with
``serve_metrics(metrics.registry, port)`` (``--metrics-port``) or renders it with ``render()``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily

from router.latency import LatencyMetrics


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.placements = Counter("pdserve_router_placements", "Placement decisions",
                                  ["policy", "pool", "worker"], registry=r)
        self.affinity_hits = Counter("pdserve_router_affinity_hits",
                                     "Turns that went to the session's bound pair", registry=r)
        self.session_moves = Counter("pdserve_router_session_moves", "Sessions moved to another pair",
                                     ["reason"], registry=r)
        self.predicted_cached_blocks = Counter("pdserve_router_predicted_cached_blocks",
                                               "Blocks the router expected cached at placement",
                                               ["pool"], registry=r)
        self.cache_hit_tokens = Counter("pdserve_router_cache_hit_tokens",
                                        "Prompt tokens served from a prefix cache (reported outcomes)",
                                        ["pool"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens placed", registry=r)
        self.kv_bytes_sent = Counter("pdserve_router_kv_bytes_sent", "KV bytes moved prefill->decode",
                                     registry=r)
        self.fallbacks = Counter("pdserve_router_fallbacks", "Fallbacks reported or taken",
                                 ["kind"], registry=r)
        self.failures = Counter("pdserve_router_request_failures", "Requests whose outcome failed",
                                registry=r)
        self.no_workers = Counter("pdserve_router_no_workers", "Placements refused: empty pool",
                                  ["pool"], registry=r)
        self.redis_errors = Counter("pdserve_router_redis_errors", "Shared-store operations that failed",
                                    ["op"], registry=r)
        self.workers = Gauge("pdserve_router_workers", "Known workers", ["pool"], registry=r)
        self.inflight = Gauge("pdserve_router_inflight_requests",
                              "Placements not yet closed by an outcome (0 when idle: no leak)", registry=r)
        self.prefill_decisions = Counter(
            "pdserve_router_prefill_decisions", "Where prompts were prefilled: mode remote (prefill pool) | "
            "local (decode worker), with the conditional-disaggregation reason", ["mode", "reason"],
            registry=r)
        self.discovery_errors = Counter("pdserve_router_discovery_errors", "Discovery list/watch errors",
                                        ["source"], registry=r)
        self.latency = LatencyMetrics(r)  # TTFT, ITL, TPOT, E2E and the stages (router/latency.py)

        # Label children resolved once: ``labels()`` costs microseconds on the decision path.
        self.predicted_prefill = self.predicted_cached_blocks.labels(pool="prefill")
        self.predicted_decode = self.predicted_cached_blocks.labels(pool="decode")
        self._placed: dict[tuple[str, str, str], object] = {}

    def watch_worker_load(self, view) -> None:
        """Export, at every scrape, the load placement sees per worker (``view.load_of``: this router's
        open placements plus other replicas' fresh reports). Once per registry."""
        if getattr(self, "_load_view", None) is None:
            self._load_view = view
            self.registry.register(_WorkerLoad(view))

    def placed(self, policy: str, pool: str, worker: str):
        key = (policy, pool, worker)
        c = self._placed.get(key)
        if c is None:
            c = self._placed[key] = self.placements.labels(policy=policy, pool=pool, worker=worker)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0"):
    """Start the Prometheus HTTP endpoint in a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=registry)


class _WorkerLoad:
    """pdserve_router_worker_load{worker}: read from the router's worker view when scraped."""

    def __init__(self, view) -> None:
        self.view = view

    def collect(self):
        family = GaugeMetricFamily("pdserve_router_worker_load",
                                   "Requests on the worker as placement sees them: this router's open "
                                   "placements plus other router replicas' fresh reports", labels=["worker"])
        for wid in list(self.view.workers):
            family.add_metric([wid], self.view.load_of(wid))
        yield family
