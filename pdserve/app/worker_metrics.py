"""A prefill or decode worker's Prometheus metrics (``--metrics-port``).

Gauges of the engine's state as the ``AsyncEngine`` thread last published it (``aengine.snapshot``), and
counters of everything the engine has done since it started (``LLMEngine.stats``): steps (and how many
of them were launched ahead of the previous step's read, engine.step_ahead), prompt tokens computed,
tokens generated, preemptions, and finished requests by reason. The counters are read at scrape time
from the engine thread's plain integers (a scrape never waits for a step); ``rate()`` over them gives
tokens per second, steps per second and the share of steps launched ahead.

Prefix-cache hits are counted in tokens by tier: ``device`` (the paged cache itself), ``host`` and
``disk`` (engine.kv_tiers, loaded back instead of recomputed). With tiers on, the tiers' traffic (bytes
and seconds moved each way), the blocks declined because recomputing was cheaper, the loads that failed
(recomputed) and each tier's bytes used and capacity are exported too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_GAUGES = (("pdserve_worker_free_blocks", "Free KV blocks", "free_blocks"),
           ("pdserve_worker_total_blocks", "KV blocks", "total_blocks"),
           ("pdserve_worker_running", "Requests in the batch", "num_running"),
           ("pdserve_worker_queue_depth", "Requests waiting", "queue_depth"))
_COUNTERS = (("pdserve_worker_steps", "Engine steps", "steps"),
             ("pdserve_worker_steps_ahead", "Engine steps launched before the previous step's tokens were "
                                            "read", "steps_ahead"),
             ("pdserve_worker_prompt_tokens", "Prompt tokens computed (prefix-cache hits not counted)",
              "prompt_tokens"),
             ("pdserve_worker_generated_tokens", "Tokens sampled", "generated_tokens"),
             ("pdserve_worker_preemptions", "Running requests preempted for KV blocks", "preemptions"))


class _EngineCounters:
    def __init__(self, stats, labels: dict[str, str], histograms=None) -> None:
        self.stats, self.labels, self.histograms = stats, labels, histograms

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        for name, help_, attr in _COUNTERS:
            family = CounterMetricFamily(name, help_, labels=names)
            family.add_metric(values, getattr(self.stats, attr))
            yield family
        finished = CounterMetricFamily("pdserve_worker_finished_requests", "Requests finished, by reason",
                                       labels=[*names, "reason"])
        for reason, n in sorted(dict(self.stats.finish_reasons).items()):
            finished.add_metric([*values, reason], n)
        yield finished
        steps = self.histograms
        if steps is None:
            return
        for name, help_, h in (
                ("pdserve_worker_step_seconds", "Engine step time (launched ahead: launch to tokens read)",
                 steps.seconds),
                ("pdserve_worker_step_batch_size", "Requests in an engine step", steps.batch_size),
                ("pdserve_worker_step_tokens", "Tokens computed in an engine step", steps.tokens)):
            family = HistogramMetricFamily(name, help_, labels=names)
            family.add_metric(values, [(floatToGoString(b), n) for b, n in h.cumulative()], sum_value=h.sum)
            yield family


class _TierMetrics:
    """Prefix-cache hits by tier, and the KV tiers' traffic and occupancy, read at scrape time."""

    def __init__(self, engine, labels: dict[str, str]) -> None:
        self.engine, self.labels = engine, labels

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        block_tokens = self.engine.block_manager.block_size
        tiers = getattr(self.engine, "tiers", None)
        hits = CounterMetricFamily("pdserve_worker_prefix_cache_hit_tokens",
                                   "Prompt tokens whose KV was reused instead of computed, by the tier it "
                                   "came from (device: the paged cache; host, disk: loaded back)",
                                   labels=[*names, "tier"])
        hits.add_metric([*values, "device"], self.engine.block_manager.hits * block_tokens)
        if tiers is not None:
            for tier, n in tiers.stats.hit_blocks.items():
                hits.add_metric([*values, tier], n * block_tokens)
        yield hits
        if tiers is None:
            return
        stats = tiers.stats
        moved = (("pdserve_worker_kv_tier_offload_bytes", "KV bytes copied into a tier",
                  stats.offloaded_bytes),
                 ("pdserve_worker_kv_tier_onload_bytes", "KV bytes loaded back from a tier",
                  stats.loaded_bytes),
                 ("pdserve_worker_kv_tier_onload_seconds", "Seconds spent loading KV back from a tier",
                  stats.load_seconds))
        for name, help_, by_tier in moved:
            family = CounterMetricFamily(name, help_, labels=[*names, "tier"])
            for tier, value in by_tier.items():
                family.add_metric([*values, tier], value)
            yield family
        for name, help_, value in (
                ("pdserve_worker_kv_tier_declined_blocks", "Blocks a tier held that were recomputed because "
                 "that was predicted faster than loading them", stats.declined_blocks),
                ("pdserve_worker_kv_tier_load_failures", "Blocks that failed to load from a tier (missing, "
                 "truncated or corrupted; recomputed)", stats.load_failures),
                ("pdserve_worker_kv_tier_disk_dropped_blocks", "Blocks not written to the disk tier because "
                 "its writer was behind (the disk is slower than the offloads)",
                 tiers.disk.dropped if tiers.disk is not None else 0)):
            family = CounterMetricFamily(name, help_, labels=names)
            family.add_metric(values, value)
            yield family
        used = GaugeMetricFamily("pdserve_worker_kv_tier_used_bytes", "Bytes a KV tier holds",
                                 labels=[*names, "tier"])
        capacity = GaugeMetricFamily("pdserve_worker_kv_tier_capacity_bytes", "Bytes a KV tier may hold",
                                     labels=[*names, "tier"])
        for tier, (n, cap) in tiers.occupancy().items():
            used.add_metric([*values, tier], n)
            capacity.add_metric([*values, tier], cap)
        yield used
        yield capacity


def worker_registry(*, role: str, worker_id: str, engine, aengine) -> CollectorRegistry:
    """The registry of one worker: ``engine`` its rank-0 ``LLMEngine``, ``aengine`` its ``AsyncEngine``."""
    registry = CollectorRegistry()
    labels = {"role": role, "worker": worker_id}
    for name, help_, attr in _GAUGES:
        g = Gauge(name, help_, list(labels), registry=registry)
        g.labels(**labels).set_function(lambda a=attr: getattr(aengine.snapshot, a))
    if getattr(engine, "stats", None) is not None:
        registry.register(_EngineCounters(engine.stats, labels, getattr(engine, "step_histograms", None)))
    if getattr(engine, "block_manager", None) is not None:
        registry.register(_TierMetrics(engine, labels))
    return registry


def serve_worker_metrics(settings, engine, aengine) -> None:
    """Serve the worker's metrics on ``settings.host:settings.metrics_port`` (a daemon thread)."""
    registry = worker_registry(role=settings.role, worker_id=settings.worker_id, engine=engine,
                               aengine=aengine)
    start_http_server(settings.metrics_port, addr=settings.host, registry=registry)
