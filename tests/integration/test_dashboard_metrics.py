"""The chart's Grafana dashboard and PrometheusRule read only what a real cluster exports.

A CPU cluster (router + 1 prefill + 1 decode, KV tiers on so the tier metrics exist) started with
``metrics_port`` lists every process in the run directory's prometheus-targets.json. After a few requests
(sessions sharing prefixes, several tokens each), every target is scraped, and every series name in every
dashboard query and every rule expression (kube-state-metrics' kube_* and the rules' own records apart)
must be one a process declares, with the suffix its type has (``_total`` of a counter, ``_bucket``, ``_sum``
or ``_count`` of a histogram, a gauge's bare name). Names whose families have no sample yet are only the
event counters listed below (they get their first sample on their first event: a shed, a worker death).

Then a real Prometheus (Debian's, as tests/integration/test_prometheus.py uses) scrapes the same
targets with the chart's rules loaded: every rule evaluates without error, and every dashboard query, sent
as Grafana would with the variables at their defaults, is accepted; those whose series all have samples
return data (a query that matches nothing, e.g. a division whose sides' labels never meet, fails here).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_process import query, running_prometheus, wait_for

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
from chart_helpers import by_kind, render  # noqa: E402
from monitoring_queries import (  # noqa: E402
    EXTERNAL_PREFIXES,
    GRAFANA_VARS,
    dashboard_queries,
    load_dashboard,
    metric_names,
    recorded_names,
    rule_groups,
    rule_queries,
    series_names,
    substitute,
)

pytestmark = pytest.mark.slow
BLOCK_BYTES = 16384  # the tiny preset: 4 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x fp32
# Labelled counters whose families are declared from the start but get a sample only on an event.
EVENT_ONLY = {"pdserve_router_admission_refused_total", "pdserve_router_no_workers_total",
              "pdserve_router_request_retries_total", "pdserve_router_worker_deaths_total",
              "pdserve_router_worker_restarts_total", "pdserve_router_session_moves_total",
              "pdserve_router_fallbacks_total", "pdserve_router_redis_errors_total",
              "pdserve_router_discovery_errors_total", "pdserve_router_allocate_queue_wait_seconds_bucket"}
# Grafana's windows for the live queries: a few of the 1 s scrapes, all of the run.
LIVE_VARS = {**GRAFANA_VARS, "__rate_interval": "1m", "__range": "10m"}


def gb(blocks: int) -> str:
    return repr(blocks * BLOCK_BYTES / 2**30)


def scrape(address: str) -> list:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return list(text_string_to_metric_families(text))


def send_requests(router: str) -> int:
    """Four sessions of three turns each, every turn the conversation so far plus new tokens (prefix-cache
    hits from the second turn), several tokens each (TPOT and ITL observed)."""
    sent, lock = [0], threading.Lock()

    def session(k: int) -> None:
        history = [5 + (j * 13 + k * 101) % 900 for j in range(40)]
        with Client(router, timeout=120) as cl:
            for turn in range(3):
                r = cl.generate(prompt_ids=history, max_tokens=6, ignore_eos=True, session_id=f"s{k}")
                history = history + list(r.token_ids) + [7 + (turn * 31 + k) % 900 for _ in range(9)]
                with lock:
                    sent[0] += 1

    threads = [threading.Thread(target=session, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return sent[0]


def test_dashboard_and_alerts_read_what_the_cluster_exports(make_checkpoint, tmp_path):
    (rule,) = by_kind(render("default", ("monitoring.prometheusRule.enabled=true",)), "PrometheusRule")
    dashboard = load_dashboard()
    queries = dashboard_queries(dashboard)
    rules = rule_queries(rule)
    recorded = recorded_names(rule)
    used: dict[str, list[str]] = {}
    for where, expr in [*queries, *rules]:
        for name in metric_names(substitute(expr)):
            if not name.startswith(EXTERNAL_PREFIXES) and name not in recorded:
                used.setdefault(name, []).append(where)
    assert len(used) >= 45

    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    with LocalCluster(model, run_dir=run_dir, metrics_port=free_port(), policy="session+prefix",
                      prefill_args=("--kv-host-gb", gb(64)),
                      decode_args=("--kv-host-gb", gb(64), "--kv-disk-dir", str(tmp_path / "kv"),
                                   "--kv-disk-gb", gb(256))) as c:
        targets_file = run_dir / "prometheus-targets.json"
        groups = json.loads(targets_file.read_text())
        assert {g["labels"]["pdserve_role"] for g in groups} == {"router", "prefill", "decode"}
        (router_metrics,) = [g["targets"][0] for g in groups if g["labels"]["pdserve_role"] == "router"]

        rules_file = tmp_path / "rules.yml"
        rules_file.write_text(yaml.safe_dump({"groups": rule_groups(rule)}))
        with running_prometheus(tmp_path, targets_file, (rules_file,)) as port:
            wait_for("every process scraped", lambda: _value(query(port, "count(up == 1)")) == 3)
            # one request first, seen by Prometheus, so the labelled series the rest add to exist
            # before them (increase() counts from a series' first sample)
            with Client(c.router, timeout=120) as cl:
                cl.generate(prompt_ids=list(range(5, 45)), max_tokens=6, ignore_eos=True)
            wait_for("the first request in Prometheus", lambda: _value(query(
                port, "sum(pdserve_router_e2e_request_latency_seconds_count)")) == 1)
            n = 1 + send_requests(c.router)
            assert n == 13

            # -- every name in a direct scrape of every process
            wait_for("the router's requests in its metrics", lambda: sum(
                s.value for f in scrape(router_metrics) for s in f.samples
                if s.name == "pdserve_router_e2e_request_latency_seconds_count") == n)
            declared: dict[str, str] = {}
            sampled: set[str] = set()
            for g in groups:
                families = scrape(g["targets"][0])
                declared.update(series_names(families))
                sampled |= {s.name for f in families for s in f.samples}
            missing = {name: where for name, where in used.items() if name not in declared}
            assert missing == {}, "the dashboard or the rules name series no process exports"
            assert set(used) - sampled <= EVENT_ONLY, set(used) - sampled - EVENT_ONLY

            # -- every rule and dashboard query in a real Prometheus
            wait_for("the requests in Prometheus", lambda: _value(query(
                port, "sum(pdserve_router_e2e_request_latency_seconds_count)")) == n)
            time.sleep(3)  # a few more scrapes and rule evaluations
            body = query(port, "vector(1)")
            assert body["status"] == "success", body
            rules_api = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules",
                                                          timeout=10).read())
            loaded = [r for g in rules_api["data"]["groups"] for r in g["rules"]]
            assert len(loaded) == len(rules)
            assert [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []
            failed, empty, checked = [], [], 0
            for where, expr in queries:
                promql = substitute(expr, LIVE_VARS)
                body = query(port, promql)
                if body["status"] != "success":
                    failed.append((where, body.get("error")))
                    continue
                names = metric_names(promql)
                if names and names <= sampled:
                    checked += 1
                    if not body["data"]["result"]:
                        empty.append((where, promql))
            assert failed == []
            assert empty == []
            assert checked >= 60, checked  # of the dashboard's 78 queries
            ttft = "pdserve_router_time_to_first_token_seconds"
            attainment = query(port, substitute(f'sum(increase({ttft}_bucket{{le="$ttft_slo"}}[$__range])) / '
                                                f"sum(increase({ttft}_count[$__range]))", LIVE_VARS))
            assert 0.0 <= _value(attainment) <= 1.0, attainment
            p50 = query(port, substitute(next(e for w, e in queries if w.startswith(
                "panel 'TTFT percentiles by mode and transport'")), LIVE_VARS))["data"]["result"]
            assert {(r["metric"]["mode"], r["metric"]["transport"]) for r in p50} == {("remote", "tcp")}
            assert all(0 < float(r["value"][1]) < 80 for r in p50), p50


def _value(body: dict) -> float | None:
    result = body.get("data", {}).get("result") if body.get("status") == "success" else None
    return float(result[0]["value"][1]) if result else None
