"""A real Prometheus (Debian's ``prometheus`` package; ``make tools`` installs it) scraping a CPU cluster
started with ``metrics_port`` (``pdserve up --metrics-port``): every process is a target through the run
directory's file-based service discovery, and PromQL's ``histogram_quantile`` of the router's TTFT and
TPOT histograms agrees with the percentiles the client measured for the same requests, within the
buckets' resolution (the router times a request from its arrival to the messages it sends; the client
from its call to the messages it receives: loopback transit apart, the same intervals)."""

from __future__ import annotations

import json
import threading
from bisect import bisect_left

import pytest
from prometheus_process import running_prometheus, scalar, wait_for

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port
from router.latency import TOKEN_BUCKETS, TTFT_BUCKETS

pytestmark = pytest.mark.slow
# How far the client's clock of a request may be from the router's: loopback transit, and on a busy 2-core
# machine the client's threads waiting for a core (the client may only be later: it receives what the
# router sent; TPOT's two ends may each be late, either way)
LATE_S, LATE_SHARE = 0.005, 0.25


def within_buckets(estimate: float, measured: float, buckets: tuple[float, ...], *, one_sided: bool) -> bool:
    """Whether PromQL's estimate lies in the buckets that could hold the router's value of what the client
    measured as ``measured`` (the router's is no later than the client's when ``one_sided``)."""
    tolerance = max(LATE_S, LATE_SHARE * measured)
    edges = (0.0, *buckets, float("inf"))
    low = max(measured - tolerance, 0.0)
    high = measured + (0.002 if one_sided else tolerance)
    lo = edges[max(bisect_left(edges, low) - 1, 0)]
    hi = edges[bisect_left(edges, high)]
    return lo <= estimate <= hi


def percentile(values: list[float], q: float) -> float:
    vals = sorted(values)
    k = (len(vals) - 1) * q
    f = int(k)
    return vals[f] + (vals[min(f + 1, len(vals) - 1)] - vals[f]) * (k - f)


def test_promql_quantiles_agree_with_the_client(make_checkpoint, tmp_path):
    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    with LocalCluster(model, run_dir=run_dir, metrics_port=free_port()) as c:
        targets = run_dir / "prometheus-targets.json"
        assert {g["labels"]["pdserve_role"] for g in json.loads(targets.read_text())} == {
            "router", "prefill", "decode"}
        with running_prometheus(tmp_path, targets) as port:
            wait_for("every process scraped", lambda: scalar(port, "count(up == 1)") == 3)

            ttft, tpot, lock = [], [], threading.Lock()

            def client(k: int) -> None:
                with Client(c.router, timeout=120) as cl:
                    for i in range(10):
                        n = 8 + 37 * ((k * 10 + i) % 7)
                        r = cl.generate(prompt_ids=[5 + (j * 13 + k) % 900 for j in range(n)],
                                        max_tokens=4 + (i % 5) * 6, ignore_eos=True)
                        with lock:
                            ttft.append(r.ttft_s)
                            tpot.append(r.tpot_s)

            threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert len(ttft) == 40
            wait_for("the router's 40 requests in Prometheus", lambda: scalar(
                port, "sum(pdserve_router_time_to_first_token_seconds_count)") == 40)
            wait_for("the workers' steps in Prometheus", lambda: (scalar(
                port, 'sum(pdserve_worker_step_seconds_count{pdserve_role="decode"})') or 0) > 0)
            for q in (0.5, 0.9):
                got = scalar(port, f"histogram_quantile({q}, sum by (le) "
                                   "(pdserve_router_time_to_first_token_seconds_bucket))")
                assert within_buckets(got, percentile(ttft, q), TTFT_BUCKETS, one_sided=True), (
                    q, got, percentile(ttft, q))
                got = scalar(port, f"histogram_quantile({q}, sum by (le) "
                                   "(pdserve_router_time_per_output_token_seconds_bucket))")
                assert within_buckets(got, percentile(tpot, q), TOKEN_BUCKETS, one_sided=False), (
                    q, got, percentile(tpot, q))
