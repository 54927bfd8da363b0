"""The chart's Grafana dashboard and PrometheusRule as PromQL, and the series names they may use.

Shared by tests/deploy/test_chart_monitoring.py (offline: the names against the metrics the code
registers) and tests/integration/test_dashboard_metrics.py (the names against a live cluster's scrapes).

A PromQL series name here is what a query selects: a gauge's name, a counter's ``<name>_total``, a
histogram's ``<name>_bucket``, ``_sum`` or ``_count``. ``series_names(families)`` turns metric families
(``prometheus_client``'s, from a registry's ``collect()`` or a parsed scrape, whose counter names come
without ``_total``) into that set, keyed by the family's type, so a query that takes ``_bucket`` of a
gauge or ``_total`` of a histogram does not pass.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
DASHBOARD = CHART / "dashboards" / "pdserve.json"

# Values Grafana substitutes at query time: its built-ins, and the dashboard's variables at their defaults.
GRAFANA_VARS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h", "namespace": ".*",
                "ttft_slo": "2.0", "tpot_slo": "0.1", "objective": "0.99"}
# Names no pdserve process exports: kube-state-metrics' (the crash-loop and workers-missing alerts, and
# the container-restarts panel read them).
EXTERNAL_PREFIXES = ("kube_",)

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "inf", "nan"}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("_sum", "_count", ""), "untyped": ("",), "info": ("_info",),
             "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable, as written (Grafana variables in)."""
    out = []
    for p in dashboard_panels(dashboard):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q)
            out.append((f"variable {v['name']}", m.group(1) if m else q))
    return out


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    """The query Grafana would send: ``$var`` and ``${var}`` replaced (every one must be known)."""
    values = values or GRAFANA_VARS

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", one, expr)  # not label_replace's $1


def rule_groups(prometheus_rule: dict) -> list[dict]:
    return prometheus_rule["spec"]["groups"]


def rule_queries(prometheus_rule: dict) -> list[tuple[str, str]]:
    return [(r.get("alert") or r["record"], r["expr"])
            for g in rule_groups(prometheus_rule) for r in g["rules"]]


def recorded_names(prometheus_rule: dict) -> set[str]:
    return {r["record"] for g in rule_groups(prometheus_rule) for r in g["rules"] if "record" in r}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: identifiers that are not functions, aggregation
    modifiers' label lists, label matchers, keywords, durations or numbers. Also checks that brackets
    balance and strings close (promtool, where the tests run it, parses for real)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    assert text.count('"') % 2 == 0 and "'" not in text and "`" not in text, f"unclosed string in {expr!r}"
    depth = []
    for ch in text:
        if ch in "([{":
            depth.append(ch)
        elif ch in ")]}":
            assert depth and "([{"[")]}".index(ch)] == depth.pop(), f"unbalanced {ch!r} in {expr!r}"
    assert not depth, f"unclosed {depth[-1]!r} in {expr!r}"
    text = re.sub(r"\{[^{}]*\}", " ", text)      # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)    # range and subquery windows
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def series_names(families) -> dict[str, str]:
    """PromQL series name -> the type of the family it belongs to."""
    out = {}
    for f in families:
        base = f.name[:-len("_total")] if f.type == "counter" and f.name.endswith("_total") else f.name
        for suffix in _SUFFIXES[f.type]:
            out[base + suffix] = f.type
    return out


def code_families() -> list:
    """The metric families the router and a worker (KV tiers on) register, read from the code itself:
    the router's registry as router/bootstrap.py composes it, and pdserve/app/worker_metrics.py's
    registry over a stand-in engine (its families do not depend on the engine's numbers)."""
    from types import SimpleNamespace

    from engine.step_histograms import StepHistograms
    from pdserve.app.worker_metrics import worker_registry
    from router.decode_mux import MuxMetrics
    from router.lifecycle import WorkerLifecycle
    from router.metrics import RouterMetrics
    from router.migration import Migration
    from router.shedding import Admission, AdmissionConfig

    router = RouterMetrics()
    router.watch_worker_load(SimpleNamespace(workers={}, load_of=lambda worker: 0))
    WorkerLifecycle(router.registry)
    MuxMetrics(router.registry)
    Admission(AdmissionConfig(), None, registry=router.registry)
    Migration(None, router.registry)
    tier_stats = SimpleNamespace(hit_blocks={"host": 0, "disk": 0}, offloaded_bytes={"host": 0, "disk": 0},
                                 loaded_bytes={"host": 0, "disk": 0}, load_seconds={"host": 0.0, "disk": 0.0},
                                 declined_blocks=0, load_failures=0)
    engine = SimpleNamespace(
        stats=SimpleNamespace(steps=0, steps_ahead=0, prompt_tokens=0, generated_tokens=0, preemptions=0,
                              finish_reasons={}),
        step_histograms=StepHistograms(), block_manager=SimpleNamespace(block_size=16, hits=0),
        tiers=SimpleNamespace(stats=tier_stats, disk=SimpleNamespace(dropped=0),
                              occupancy=lambda: {"host": (0, 1), "disk": (0, 1)}))
    aengine = SimpleNamespace(snapshot=SimpleNamespace(free_blocks=0, total_blocks=0, num_running=0,
                                                       queue_depth=0))
    worker = worker_registry(role="decode", worker_id="d0", engine=engine, aengine=aengine)
    return [*router.registry.collect(), *worker.collect()]

