"""A real Prometheus (Debian's ``prometheus`` package; ``make tools`` installs it) scraping a CPU cluster
started with ``metrics_port`` (``pdserve up --metrics-port``): every process is a target through the run
directory's file-based service discovery, and PromQL's ``histogram_quantile`` of the router's TTFT and
TPOT histograms agrees with the percentiles the client measured for the same requests, within the
buckets' resolution (the router times a request from its arrival to the messages it sends; the client
from its call to the messages it receives: loopback transit apart, the same intervals)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from bisect import bisect_left

import pytest
import yaml

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port
from router.latency import TOKEN_BUCKETS, TTFT_BUCKETS

pytestmark = pytest.mark.slow
TRANSIT_S = 0.005  # client vs router clocks of one message: loopback, a busy 2-core machine


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(port: int, promql: str) -> float | None:
    result = query(port, promql)
    return float(result[0]["value"][1]) if result else None


def wait_for(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def within_buckets(estimate: float, measured: float, buckets: tuple[float, ...]) -> bool:
    """Whether PromQL's estimate lies in the buckets that could hold the measured value, give or take
    the transit between the two clocks."""
    edges = (0.0, *buckets, float("inf"))
    lo = edges[bisect_left(edges, max(measured - TRANSIT_S, 0.0)) - 1] if measured > TRANSIT_S else 0.0
    hi = edges[bisect_left(edges, measured + TRANSIT_S)]
    return lo <= estimate <= hi


def percentile(values: list[float], q: float) -> float:
    vals = sorted(values)
    k = (len(vals) - 1) * q
    f = int(k)
    return vals[f] + (vals[min(f + 1, len(vals) - 1)] - vals[f]) * (k - f)


def test_promql_quantiles_agree_with_the_client(make_checkpoint, tmp_path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus package is needed: `make tools` installs it (root)"
    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    with LocalCluster(model, run_dir=run_dir, metrics_port=free_port()) as c:
        targets = run_dir / "prometheus-targets.json"
        assert {g["labels"]["pdserve_role"] for g in json.loads(targets.read_text())} == {
            "router", "prefill", "decode"}
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "pdserve",
                                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}]}))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "w")
        tsdb = tmp_path / "tsdb"
        proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for("Prometheus ready", lambda: _ready(port))
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
                assert within_buckets(got, percentile(ttft, q), TTFT_BUCKETS), (q, got, percentile(ttft, q))
                got = scalar(port, f"histogram_quantile({q}, sum by (le) "
                                   "(pdserve_router_time_per_output_token_seconds_bucket))")
                assert within_buckets(got, percentile(tpot, q), TOKEN_BUCKETS), (q, got, percentile(tpot, q))
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def _ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200
    except OSError:
        return False
