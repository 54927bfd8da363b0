"""The router's latency histograms (router/latency.py): one request's clock observes TTFT, ITL (per token
of each message), TPOT and E2E under its mode and transport, and the stages of its facts."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from pdserve.v1 import common_pb2
from router.latency import LatencyMetrics, RequestClock


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_one_remote_request_is_observed_once_in_each_histogram(monkeypatch) -> None:
    registry = CollectorRegistry()
    metrics = LatencyMetrics(registry)
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = RequestClock(metrics, start=99.9)  # arrived 100 ms before the first token
    clock.sent(1)  # token 1 at 100.0
    now[0] = 100.04
    clock.sent(4)  # 4 tokens 40 ms later: 10 ms each
    now[0] = 100.06
    clock.sent(1)
    now[0] = 100.07
    clock.done(common_pb2.RequestFacts(prefill_mode="remote", transport="nixl", allocate_ms=2.0,
                                       prefill_queue_ms=5.0, prefill_compute_ms=30.0, kv_transfer_ms=4.0,
                                       kv_wait_ms=1.0, kv_bytes_sent=1 << 20))
    assert value(registry, "pdserve_router_time_to_first_token_seconds_count", mode="remote",
                 transport="nixl") == 1
    assert abs(value(registry, "pdserve_router_time_to_first_token_seconds_sum", mode="remote",
                     transport="nixl") - 0.1) < 1e-9
    # ITL: one observation per message after the first, its gap over its tokens
    assert value(registry, "pdserve_router_inter_token_latency_seconds_count", mode="remote") == 2
    assert abs(value(registry, "pdserve_router_inter_token_latency_seconds_sum", mode="remote")
               - (0.01 + 0.02)) < 1e-9
    # TPOT: (last - first) / (tokens - 1) = 0.06 / 5
    tpot = value(registry, "pdserve_router_time_per_output_token_seconds_sum", mode="remote")
    assert abs(tpot - 0.012) < 1e-9
    assert abs(value(registry, "pdserve_router_e2e_request_latency_seconds_sum", mode="remote") - 0.17) < 1e-9
    assert value(registry, "pdserve_router_prefill_compute_seconds_sum") == 0.03
    assert value(registry, "pdserve_router_kv_transfer_bytes_sum", transport="nixl") == 1 << 20
    assert value(registry, "pdserve_router_kv_transfer_seconds_count", transport="nixl") == 1
    assert value(registry, "pdserve_router_allocate_seconds_count") == 1


def test_a_local_prefill_has_no_prefill_pool_stages(monkeypatch) -> None:
    registry = CollectorRegistry()
    clock = RequestClock(LatencyMetrics(registry))
    clock.sent(1)
    clock.done(common_pb2.RequestFacts(prefill_mode="local", transport="local", allocate_ms=1.0))
    assert value(registry, "pdserve_router_time_to_first_token_seconds_count", mode="local",
                 transport="local") == 1
    assert value(registry, "pdserve_router_time_per_output_token_seconds_count", mode="local") == 0
    assert value(registry, "pdserve_router_prefill_compute_seconds_count") == 0
    # a request that ended before any token: no TTFT, an E2E
    other = CollectorRegistry()
    RequestClock(LatencyMetrics(other)).done(common_pb2.RequestFacts(prefill_mode="remote"))
    assert value(other, "pdserve_router_e2e_request_latency_seconds_count", mode="remote") == 1
    assert value(other, "pdserve_router_time_to_first_token_seconds_count", mode="remote",
                 transport="none") == 0
