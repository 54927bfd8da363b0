"""Request latency histograms of the router: the SLO signals an operator pages on, in seconds and bytes.

One ``LatencyMetrics`` per router process, on the router's registry (``router/metrics.py``). Both doors
time each request through ``generate_messages`` with a ``RequestClock``: arrival to the first token
(TTFT), the gaps between token messages (ITL, per message: with ``--stream-interval N`` one observation
stands for N tokens, its gap divided by them), first to last token over the tokens after the first
(TPOT), arrival to the end (E2E); and, from the request's facts, where its time to the first token went
(placement, Allocate, the prefill worker's queue and compute, the KV transfer and its wait) and the KV
bytes moved. Names and meanings follow vLLM's where they are the same (``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``e2e_request_latency_seconds``); labels stay small: ``mode``
(remote: the prefill pool; local: the decode worker prefilled) and ``transport`` (nixl, tcp, local),
never a request or session id, so PromQL aggregates them across router replicas.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram

# Buckets fit for SLOs of tens of milliseconds to seconds (TTFT) and milliseconds (ITL, TPOT): each
# target an operator is likely to set sits on a boundary, so histogram_quantile resolves it.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5,
                2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(float(4 ** k) for k in range(6, 17))  # 4 KiB .. 4 GiB


class LatencyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = Histogram("pdserve_router_time_to_first_token_seconds",
                              "Arrival at the router to the first token sent", ["mode", "transport"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router_inter_token_latency_seconds",
                             "Gap between token messages, per token they carry", ["mode"],
                             buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_router_time_per_output_token_seconds",
                              "First to last token over the tokens after the first, per request", ["mode"],
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_request_latency_seconds",
                             "Arrival at the router to the last message", ["mode"], buckets=E2E_BUCKETS,
                             registry=r)
        self.placement = Histogram("pdserve_router_placement_seconds",
                                   "Placement decisions (the pair chosen)", buckets=STAGE_BUCKETS, registry=r)
        self.allocate = Histogram("pdserve_router_allocate_seconds",
                                  "The decode worker's Allocate, its wait for free blocks included",
                                  buckets=STAGE_BUCKETS, registry=r)
        self.prefill_queue = Histogram("pdserve_router_prefill_queue_seconds",
                                       "Prompts waiting in the prefill worker's engine queue",
                                       buckets=STAGE_BUCKETS, registry=r)
        self.prefill_compute = Histogram("pdserve_router_prefill_compute_seconds",
                                         "The prefill worker computing a prompt", buckets=STAGE_BUCKETS,
                                         registry=r)
        self.kv_transfer = Histogram("pdserve_router_kv_transfer_seconds",
                                     "A prompt's KV push, start to the decode side's acknowledgement",
                                     ["transport"], buckets=STAGE_BUCKETS, registry=r)
        self.kv_wait = Histogram("pdserve_router_kv_wait_seconds",
                                 "How long a first token waited for its KV's acknowledgement after "
                                 "the prefill",
                                 ["transport"], buckets=STAGE_BUCKETS, registry=r)
        self.decode_join = Histogram("pdserve_router_decode_join_seconds",
                                     "A Decode stream's start to its first tokens: the decode worker's wait "
                                     "for the KV, then for a place in its batch", ["mode"],
                                     buckets=STAGE_BUCKETS, registry=r)
        self.kv_bytes = Histogram("pdserve_router_kv_transfer_bytes",
                                  "KV bytes moved prefill -> decode per request", ["transport"],
                                  buckets=BYTES_BUCKETS, registry=r)


class RequestClock:
    """One request's timeline, observed into ``LatencyMetrics`` as its messages go out (nothing is
    observed without metrics: a pipeline double in a test)."""

    __slots__ = ("metrics", "start", "first", "last", "tokens")

    def __init__(self, metrics: LatencyMetrics | None, start: float | None = None) -> None:
        self.metrics = metrics
        self.start = time.perf_counter() if start is None else start
        self.first = self.last = 0.0
        self.tokens = 0

    def sent(self, n: int, mode: str = "remote") -> None:
        """A message with ``n`` tokens went out (the first of them is token 1 when none came before)."""
        if self.metrics is None:
            return
        now = time.perf_counter()
        if not self.tokens:
            self.first = now
        elif n:
            self.metrics.itl.labels(mode).observe((now - self.last) / n)
        self.last = now
        self.tokens += n

    def done(self, facts) -> None:
        """The request ended; ``facts`` is its RequestFacts (mode, transport, stage timings, bytes)."""
        m = self.metrics
        if m is None:
            return
        mode = facts.prefill_mode or "remote"
        transport = facts.transport or ("local" if mode == "local" else "none")
        end = time.perf_counter()
        if self.tokens:
            m.ttft.labels(mode, transport).observe(self.first - self.start)
        if self.tokens > 1:
            m.tpot.labels(mode).observe((self.last - self.first) / (self.tokens - 1))
        m.e2e.labels(mode).observe(end - self.start)
        if facts.allocate_ms:
            m.allocate.observe(facts.allocate_ms / 1e3)
        if mode != "remote":
            return
        m.prefill_queue.observe(facts.prefill_queue_ms / 1e3)
        m.prefill_compute.observe(facts.prefill_compute_ms / 1e3)
        if facts.kv_bytes_sent:
            m.kv_bytes.labels(transport).observe(facts.kv_bytes_sent)
            m.kv_transfer.labels(transport).observe(facts.kv_transfer_ms / 1e3)
            m.kv_wait.labels(transport).observe(facts.kv_wait_ms / 1e3)
