"""A prefill or decode worker's Prometheus metrics (``--metrics-port``).

Gauges of the engine's state as the ``AsyncEngine`` thread last published it (``aengine.snapshot``), and
counters of everything the engine has done since it started (``LLMEngine.stats``): steps (and how many
of them were launched ahead of the previous step's read, engine.step_ahead), prompt tokens computed,
tokens generated, preemptions, and finished requests by reason. The counters are read at scrape time
from the engine thread's plain integers (a scrape never waits for a step); ``rate()`` over them gives
tokens per second, steps per second and the share of steps launched ahead.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily

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
    def __init__(self, stats, labels: dict[str, str]) -> None:
        self.stats, self.labels = stats, labels

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


def worker_registry(*, role: str, worker_id: str, engine, aengine) -> CollectorRegistry:
    """The registry of one worker: ``engine`` its rank-0 ``LLMEngine``, ``aengine`` its ``AsyncEngine``."""
    registry = CollectorRegistry()
    labels = {"role": role, "worker": worker_id}
    for name, help_, attr in _GAUGES:
        g = Gauge(name, help_, list(labels), registry=registry)
        g.labels(**labels).set_function(lambda a=attr: getattr(aengine.snapshot, a))
    if getattr(engine, "stats", None) is not None:
        registry.register(_EngineCounters(engine.stats, labels))
    return registry


def serve_worker_metrics(settings, engine, aengine) -> None:
    """Serve the worker's metrics on ``settings.host:settings.metrics_port`` (a daemon thread)."""
    registry = worker_registry(role=settings.role, worker_id=settings.worker_id, engine=engine,
                               aengine=aengine)
    start_http_server(settings.metrics_port, addr=settings.host, registry=registry)
