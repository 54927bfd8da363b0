"""The chart's monitoring: the Grafana dashboard ConfigMap, the PrometheusRule and the ServiceMonitor.

- Both are off by default (the golden renders stay as they are) and turning one on adds exactly its
  object and changes nothing else.
- The dashboard JSON validates against a JSON schema of Grafana's dashboard model written here (Grafana
  publishes its schema as CUE inside the AGPL grafana repository, and no package this project installs
  ships it as JSON schema): the fields Grafana needs to load a dashboard of schemaVersion 39, panels on the
  24-column grid without overlaps, every target with a refId and a PromQL expr against the templated
  Prometheus data source.
- Every PromQL expression (dashboard targets and variables with Grafana's variables substituted, and every
  rule) parses with promtool, and names only series the code registers (kube-state-metrics' kube_* and
  the rules' own records excepted), each with the suffix its type has.
- The alerts fire when they should and not otherwise: `promtool test rules` on synthetic series.
- The SLO targets are histogram bucket boundaries, and the rules' le labels are written as the router
  prints them.
- The ServiceMonitor reaches the metrics port of every role.

tests/integration/test_dashboard_metrics.py checks the same names against a live cluster's scrapes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_helpers import REPO, by_kind, render, render_fails, run_helm, template_args
from monitoring_queries import (
    DASHBOARD,
    EXTERNAL_PREFIXES,
    code_families,
    dashboard_panels,
    dashboard_queries,
    load_dashboard,
    metric_names,
    recorded_names,
    rule_groups,
    rule_queries,
    series_names,
    substitute,
)
from prometheus_client.utils import floatToGoString

from router.latency import TOKEN_BUCKETS, TTFT_BUCKETS

DASH_ON = ("monitoring.dashboard.enabled=true",)
RULE_ON = ("monitoring.prometheusRule.enabled=true",)
BOTH_ON = DASH_ON + RULE_ON
NO_VALUE = object()
K8S_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())  # as test_chart_render.py


def promtool() -> str:
    """promtool comes with Debian's prometheus package (`make tools` installs it); missing is a failure."""
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool not found: run `make tools` (apt-get install prometheus)")
    return found


def run_promtool(*args: str) -> str:
    proc = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def prometheus_rule(sets: tuple[str, ...] = ()) -> dict:
    (rule,) = by_kind(render("default", RULE_ON + sets), "PrometheusRule")
    return rule


def dashboard_configmap(sets: tuple[str, ...] = ()) -> dict:
    docs = render("default", DASH_ON + sets)
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    return cm


# ----------------------------------------------------------------------------------------- the renders


def test_off_by_default() -> None:
    docs = render("default")
    assert not by_kind(docs, "PrometheusRule")
    assert not [d for d in by_kind(docs, "ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]]


@pytest.mark.parametrize("sets,kind", [(DASH_ON, "ConfigMap"), (RULE_ON, "PrometheusRule")])
def test_turning_one_on_adds_only_its_object(sets: tuple[str, ...], kind: str) -> None:
    base = render("default")
    docs = render("default", sets)
    added = [d for d in docs if d not in base]
    assert [d["kind"] for d in added] == [kind]
    assert [d for d in docs if d not in added] == base
    both = render("default", BOTH_ON)
    assert sorted(d["kind"] for d in both if d not in base) == ["ConfigMap", "PrometheusRule"]


def test_dashboard_configmap_carries_the_json_for_the_sidecar() -> None:
    cm = dashboard_configmap()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "pdserve"
    assert list(cm["data"]) == ["pdserve.json"]
    assert json.loads(cm["data"]["pdserve.json"]) == load_dashboard()
    assert cm["data"]["pdserve.json"] == DASHBOARD.read_text().rstrip("\n")  # byte for byte
    assert len(cm["data"]["pdserve.json"]) < 900_000  # a ConfigMap holds at most 1 MiB
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(cm, version, strict=True)


def test_dashboard_configmap_label_namespace_and_annotations_are_values() -> None:
    cm = dashboard_configmap(("monitoring.dashboard.label=grafana.io/dashboard",
                              "monitoring.dashboard.labelValue=pdserve",
                              "monitoring.dashboard.namespace=monitoring",
                              "monitoring.dashboard.annotations.grafana_folder=LLM"))
    labels = cm["metadata"]["labels"]
    assert labels["grafana.io/dashboard"] == "pdserve" and "grafana_dashboard" not in labels
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_prometheus_rule_shape_and_labels() -> None:
    rule = prometheus_rule(("monitoring.prometheusRule.labels.release=kube-prometheus-stack",
                            "monitoring.prometheusRule.alertLabels.team=serving"))
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = {r["alert"]: r for g in rule_groups(rule) for r in g["rules"] if "alert" in r}
    assert set(alerts) == {
        "PdserveTTFTSLOBudgetFastBurn", "PdserveTTFTSLOBudgetSlowBurn", "PdserveTPOTSLOBudgetFastBurn",
        "PdserveTPOTSLOBudgetSlowBurn", "PdservePodCrashLooping", "PdserveWorkerDying",
        "PdserveWorkersMissing", "PdservePoolEmpty", "PdserveRouterAbsent"}
    for name, r in alerts.items():
        assert r["labels"]["team"] == "serving" and r["labels"]["severity"], name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
    assert alerts["PdserveTTFTSLOBudgetFastBurn"]["labels"]["severity"] == "critical"
    assert alerts["PdserveTPOTSLOBudgetSlowBurn"]["labels"]["severity"] == "warning"
    # every series the rules read is the release's: its namespace, and the router Service's job (or
    # kube-state-metrics' series of the release's pods and Deployments)
    for where, expr in rule_queries(rule):
        assert 'namespace="pdserve"' in expr, where
        if "pdserve_router_" in expr or "pdserve:" in expr:
            assert 'job="pdserve-router"' in expr, where


def test_prometheus_rule_files_pass_promtool(tmp_path: Path) -> None:
    """promtool parses every expression and template, and checks the groups' structure (a rule file is what
    the operator writes from the PrometheusRule's spec)."""
    for sets in ((), ("fullnameOverride=llm.serving", "monitoring.prometheusRule.slo.ttftSeconds=10"),):
        rule = prometheus_rule(sets)
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump({"groups": rule_groups(rule)}))
        out = run_promtool("check", "rules", str(path))
        assert "SUCCESS: 17 rules found" in out
    assert 'deployment=~"llm\\\\.serving-(prefill|decode)"' in " ".join(e for _, e in rule_queries(rule))


# --------------------------------------------------------------------------- the SLO targets and le labels


def test_slo_targets_must_be_bucket_boundaries() -> None:
    schema = json.loads((REPO / "deploy/helm/pdserve/values.schema.json").read_text())
    rule = schema["properties"]["monitoring"]["properties"]["prometheusRule"]
    slo = rule["properties"]["slo"]["properties"]
    assert slo["ttftSeconds"]["enum"] == list(TTFT_BUCKETS)
    assert slo["tpotSeconds"]["enum"] == list(TOKEN_BUCKETS)
    assert "ttftSeconds" in render_fails("default", ("monitoring.prometheusRule.slo.ttftSeconds=4",))


@pytest.mark.parametrize("ttft,tpot", [(2, 0.1), (0.075, 0.0025), (80, 1), (10, 0.0125)])
def test_rule_le_labels_are_written_as_the_router_prints_them(tmp_path: Path, ttft: float,
                                                              tpot: float) -> None:
    """le="2.0", not "2": a label matcher is an exact string; prometheus_client prints Python's float repr."""
    values = tmp_path / "slo.yaml"
    values.write_text(yaml.safe_dump({"monitoring": {"prometheusRule": {"enabled": True, "slo": {
        "ttftSeconds": ttft, "tpotSeconds": tpot}}}}))
    text = run_helm(*template_args(), "-f", str(values), "-s", "templates/prometheusrule.yaml").stdout
    exprs = " ".join(e for _, e in rule_queries(yaml.safe_load(text)))
    assert f'pdserve_router_time_to_first_token_seconds_bucket{{namespace="pdserve",job="pdserve-router",' \
           f'le="{floatToGoString(ttft)}"}}' in exprs
    assert f'pdserve_router_time_per_output_token_seconds_bucket{{namespace="pdserve",job="pdserve-router",' \
           f'le="{floatToGoString(tpot)}"}}' in exprs


def test_dashboard_slo_variables_offer_the_bucket_boundaries_and_default_to_the_rules() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    for name, buckets in (("ttft_slo", TTFT_BUCKETS), ("tpot_slo", TOKEN_BUCKETS)):
        v = variables[name]
        assert v["type"] == "custom"
        assert v["query"].split(",") == [floatToGoString(b) for b in buckets]
        assert [o["value"] for o in v["options"]] == [floatToGoString(b) for b in buckets]
    defaults = yaml.safe_load((REPO / "deploy/helm/pdserve/values.yaml").read_text())["monitoring"][
        "prometheusRule"]["slo"]
    assert variables["ttft_slo"]["current"]["value"] == floatToGoString(defaults["ttftSeconds"])
    assert variables["tpot_slo"]["current"]["value"] == floatToGoString(defaults["tpotSeconds"])
    assert float(variables["objective"]["current"]["value"]) == defaults["objective"]


# ------------------------------------------------------------------------------- the dashboard's schema

_DS_REF = {"type": "object", "required": ["type", "uid"], "additionalProperties": False,
           "properties": {"type": {"const": "prometheus"}, "uid": {"const": "${datasource}"}}}
_GRID = {"type": "object", "required": ["h", "w", "x", "y"], "additionalProperties": False,
         "properties": {"h": {"type": "integer", "minimum": 1},
                        "w": {"type": "integer", "minimum": 1, "maximum": 24},
                        "x": {"type": "integer", "minimum": 0, "maximum": 23},
                        "y": {"type": "integer", "minimum": 0},
                        "static": {"type": "boolean"}}}
_TARGET = {"type": "object", "required": ["refId", "expr", "datasource"],
           "properties": {"refId": {"type": "string", "pattern": "^[A-Z]$"},
                          "expr": {"type": "string", "minLength": 1},
                          "datasource": _DS_REF, "legendFormat": {"type": "string"},
                          "instant": {"type": "boolean"}, "range": {"type": "boolean"},
                          "hide": {"type": "boolean"}, "interval": {"type": "string"}}}
_THRESHOLDS = {"type": "object", "required": ["mode", "steps"],
               "properties": {"mode": {"enum": ["absolute", "percentage"]},
                              "steps": {"type": "array", "minItems": 1, "items": {
                                  "type": "object", "required": ["color", "value"],
                                  "properties": {"color": {"type": "string"},
                                                 "value": {"type": ["number", "null"]}}}}}}
_FIELD_CONFIG = {"type": "object", "required": ["defaults", "overrides"],
                 "properties": {"defaults": {"type": "object", "properties": {
                     "unit": {"type": "string"}, "min": {"type": ["number", "null"]},
                     "max": {"type": ["number", "null"]}, "decimals": {"type": ["integer", "null"]},
                     "thresholds": _THRESHOLDS, "custom": {"type": "object"}}},
                     "overrides": {"type": "array", "items": {
                         "type": "object", "required": ["matcher", "properties"],
                         "properties": {"matcher": {"type": "object", "required": ["id"]},
                                        "properties": {"type": "array", "items": {
                                            "type": "object", "required": ["id"]}}}}}}}
_PANEL = {"type": "object", "required": ["type", "id", "title", "gridPos"],
          "properties": {"type": {"type": "string", "minLength": 1}, "id": {"type": "integer", "minimum": 1},
                         "title": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                         "gridPos": _GRID},
          "if": {"properties": {"type": {"const": "row"}}},
          "then": {"required": ["collapsed", "panels"],
                   "properties": {"collapsed": {"type": "boolean"}, "panels": {"type": "array"},
                                  "gridPos": {"properties": {"w": {"const": 24}, "h": {"const": 1},
                                                             "x": {"const": 0}}}}},
          "else": {"required": ["datasource", "targets", "fieldConfig", "options"],
                   "properties": {"type": {"enum": ["timeseries", "stat", "gauge", "bargauge", "table",
                                                    "heatmap", "text", "barchart", "piechart"]},
                                  "datasource": _DS_REF, "fieldConfig": _FIELD_CONFIG,
                                  "options": {"type": "object"},
                                  "targets": {"type": "array", "minItems": 1, "items": _TARGET}}}}
_VARIABLE = {"type": "object", "required": ["type", "name"],
             "properties": {"type": {"enum": ["query", "adhoc", "constant", "datasource", "interval",
                                              "textbox", "custom", "system"]},
                            "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                            "label": {"type": "string"}, "hide": {"enum": [0, 1, 2]},
                            "multi": {"type": "boolean"}, "includeAll": {"type": "boolean"},
                            "options": {"type": "array"}, "current": {"type": "object"}},
             "allOf": [
                 {"if": {"properties": {"type": {"const": "datasource"}}},
                  "then": {"required": ["query"], "properties": {"query": {"const": "prometheus"}}}},
                 {"if": {"properties": {"type": {"const": "query"}}},
                  "then": {"required": ["query", "datasource", "refresh"],
                           "properties": {"datasource": _DS_REF, "refresh": {"enum": [0, 1, 2]}}}},
                 {"if": {"properties": {"type": {"const": "custom"}}},
                  "then": {"required": ["query", "options", "current"],
                           "properties": {"query": {"type": "string", "minLength": 1}}}}]}
GRAFANA_DASHBOARD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Grafana dashboard model (the subset pdserve's dashboard uses; Grafana's dashboard kind, v0)",
    "type": "object",
    "required": ["title", "uid", "panels", "schemaVersion", "templating", "time", "annotations", "editable",
                 "refresh", "tags"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "id": {"type": ["integer", "null"]},
        "schemaVersion": {"type": "integer", "minimum": 36, "maximum": 41},
        "version": {"type": "integer", "minimum": 0},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "refresh": {"type": "string", "pattern": "^([0-9]+(s|m|h|d))?$"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "timezone": {"type": "string"},
        "time": {"type": "object", "required": ["from", "to"],
                 "properties": {"from": {"type": "string"}, "to": {"type": "string"}}},
        "annotations": {"type": "object", "required": ["list"], "properties": {"list": {"type": "array"}}},
        "templating": {"type": "object", "required": ["list"],
                       "properties": {"list": {"type": "array", "items": _VARIABLE}}},
        "panels": {"type": "array", "minItems": 1, "items": _PANEL},
    },
}


def schema_errors(dashboard: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(GRAFANA_DASHBOARD_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(dashboard)]


def test_the_schema_itself_is_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(GRAFANA_DASHBOARD_SCHEMA)


def test_dashboard_validates_against_grafanas_dashboard_schema() -> None:
    dashboard = load_dashboard()
    assert schema_errors(dashboard) == []
    assert dashboard["schemaVersion"] == 39


@pytest.mark.parametrize("path,value", [
    (("panels", 1, "gridPos"), NO_VALUE),
    (("panels", 1, "gridPos", "w"), 25),
    (("panels", 1, "targets", 0, "refId"), NO_VALUE),
    (("panels", 1, "targets", 0, "expr"), NO_VALUE),
    (("panels", 1, "datasource"), {"type": "prometheus", "uid": "prometheus"}),  # not the variable
    (("panels", 1, "type"), NO_VALUE),
    (("templating",), NO_VALUE),
    (("schemaVersion",), "39"),
    (("templating", "list", 0, "query"), "loki"),
])
def test_the_schema_rejects_broken_dashboards(path: tuple, value: object) -> None:
    """Negative controls: the schema is not vacuous."""
    dashboard = load_dashboard()
    node = dashboard
    for key in path[:-1]:
        node = node[key]
    if value is NO_VALUE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    assert schema_errors(dashboard)


def test_dashboard_layout_ids_and_variables() -> None:
    dashboard = load_dashboard()
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "namespace", "ttft_slo", "tpot_slo", "objective"]
    for where, expr in dashboard_queries(dashboard):
        substitute(expr)  # raises on a variable the dashboard does not define
        if where.startswith("panel"):
            assert 'namespace=~"$namespace"' in expr or "pdserve_" not in expr, where


def test_dashboard_covers_the_signals() -> None:
    """SLO attainment, percentiles by mode and transport, KV transfer, cache hits, queues, sheds, restarts
    and KV tiers each have a panel reading them."""
    by_title = {p["title"]: " ".join(t["expr"] for t in p.get("targets", []))
                for p in dashboard_panels(load_dashboard())}
    assert 'le="$ttft_slo"' in by_title["TTFT attainment (TTFT <= $ttft_slo s)"]
    assert 'le="$tpot_slo"' in by_title["TPOT attainment (TPOT <= $tpot_slo s)"]
    everything = " ".join(by_title.values())
    for needle in ("sum by (le, mode, transport) (rate(pdserve_router_time_to_first_token_seconds_bucket",
                   "sum by (le, mode) (rate(pdserve_router_time_per_output_token_seconds_bucket",
                   "pdserve_router_inter_token_latency_seconds_bucket",
                   "pdserve_router_e2e_request_latency_seconds",
                   "pdserve_router_prefill_queue_seconds_sum", "pdserve_router_kv_wait_seconds_sum",
                   "sum by (transport) (rate(pdserve_router_kv_transfer_bytes_sum",
                   "pdserve_router_cache_hit_tokens_total", "pdserve_router_prompt_tokens_total",
                   "pdserve_worker_prefix_cache_hit_tokens_total", "pdserve_worker_queue_depth",
                   "pdserve_worker_running", "pdserve_worker_free_blocks",
                   "pdserve_router_admission_refused_total",
                   "pdserve_router_request_failures_total", "pdserve_router_worker_restarts_total",
                   "pdserve_router_worker_deaths_total", "kube_pod_container_status_restarts_total",
                   "pdserve_worker_kv_tier_used_bytes", "pdserve_worker_kv_tier_onload_bytes_total"):
        assert needle in everything, needle


# -------------------------------------------------------------------------------- PromQL and the names


def test_metric_names_extraction() -> None:
    quantile = 'histogram_quantile(0.9, sum by (le, mode) (rate(a_bucket{le="1.0",x=~"a|b"}[5m])))'
    assert metric_names(quantile) == {"a_bucket"}
    assert metric_names("sum by (pool) (rate(a_total[1m])) / on () group_left () sum(b) > bool 0.5") \
        == {"a_total", "b"}
    assert metric_names('x:y:ratio_rate5m{job="j"} > (14.4 * (1 - 0.99)) and vector(1) unless absent(z)') \
        == {"x:y:ratio_rate5m", "z"}
    assert metric_names('label_replace(k{d=~"a-(b)"}, "pool", "$1", "d", "a-(b)")') == {"k"}
    for broken in ("sum(rate(a[5m])", 'a{b="c}', "a[5m)"):
        with pytest.raises(AssertionError):
            metric_names(broken)


def test_every_query_parses(tmp_path: Path) -> None:
    """Each dashboard query, as Grafana sends it with the variables at their defaults, and each rule's
    expression, through promtool's PromQL parser (as recording rules of a scratch file)."""
    queries = [(w, substitute(e)) for w, e in dashboard_queries(load_dashboard())]
    queries += rule_queries(prometheus_rule())
    rules = [{"record": f"check:query_{n}", "expr": e} for n, (_, e) in enumerate(queries)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    out = run_promtool("check", "rules", str(path))
    assert f"SUCCESS: {len(rules)} rules found" in out


def test_every_name_is_one_the_code_exports() -> None:
    exported = series_names(code_families())
    rule = prometheus_rule()
    recorded = recorded_names(rule)
    used: dict[str, list[str]] = {}
    for where, expr in [*dashboard_queries(load_dashboard()), *rule_queries(rule)]:
        for name in metric_names(substitute(expr)):
            used.setdefault(name, []).append(where)
    unknown = {n: w for n, w in used.items()
               if n not in exported and n not in recorded and not n.startswith(EXTERNAL_PREFIXES)}
    assert unknown == {}
    assert len([n for n in used if n in exported]) >= 45
    # every rule record is read by an alert of the rule (none is dead)
    assert recorded <= set(used)


def test_names_check_catches_a_wrong_suffix() -> None:
    """Negative control: a counter without _total, a gauge's _bucket or an unknown name is no export."""
    exported = series_names(code_families())
    assert "pdserve_router_admission_refused_total" in exported
    assert "pdserve_router_admission_refused" not in exported
    assert "pdserve_worker_queue_depth" in exported and "pdserve_worker_queue_depth_bucket" not in exported
    assert "pdserve_router_time_to_first_token_seconds_bucket" in exported
    assert "pdserve_router_time_to_first_token_seconds_total" not in exported


# ------------------------------------------------------------------------------------ the alerts, fired

_ROUTER = 'namespace="pdserve",job="pdserve-router"'


def _slo_series(metric: str, le: str, good_per_min: int, total_per_min: int = 100) -> list[dict]:
    labels = f'{_ROUTER},mode="remote"'
    return [{"series": f'{metric}_bucket{{{labels},le="{le}"}}', "values": f"0+{good_per_min}x400"},
            {"series": f"{metric}_count{{{labels}}}", "values": f"0+{total_per_min}x400"}]


def _restarts(pod: str, container: str) -> str:
    labels = f'namespace="pdserve",pod="{pod}",container="{container}"'
    return f"kube_pod_container_status_restarts_total{{{labels}}}"


def _at(eval_time: str, alerts: tuple[str, list[dict]]) -> dict:
    """An alert_rule_test: at ``eval_time``, alert ``name`` firing exactly with these label sets."""
    name, labels = alerts
    return {"eval_time": eval_time, "alertname": name, "exp_alerts": [{"exp_labels": lb} for lb in labels]}


def _alerts(name: str, *labels: dict) -> tuple[str, list[dict]]:
    return name, list(labels)


def test_alerts_fire_when_they_should(tmp_path: Path) -> None:
    """`promtool test rules` over synthetic series: 20% of requests over the TTFT target burns a 1% budget
    20x (fast and slow burn), 10% burns it 10x (slow burn only), 0.5% burns none; restarts, deaths and
    missing workers fire their alerts, a pool scaled to zero does not count as empty."""
    rule = prometheus_rule()
    groups = rule_groups(rule)
    for g in groups:
        for r in g["rules"]:
            r.pop("annotations", None)  # templates checked by `promtool check rules`; not compared here
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    ttft = "pdserve_router_time_to_first_token_seconds"
    tpot = "pdserve_router_time_per_output_token_seconds"
    base = {"namespace": "pdserve", "job": "pdserve-router"}
    crit_ttft = {**base, "severity": "critical", "slo": "ttft"}
    warn_ttft = {**base, "severity": "warning", "slo": "ttft"}
    crit_tpot = {**base, "severity": "critical", "slo": "tpot"}
    tests = [
        {"interval": "1m", "input_series": _slo_series(ttft, "2.0", 80) + _slo_series(tpot, "0.1", 100),
         "alert_rule_test": [_at("70m", _alerts("PdserveTTFTSLOBudgetFastBurn", crit_ttft)),
                             _at("70m", _alerts("PdserveTTFTSLOBudgetSlowBurn", warn_ttft)),
                             _at("70m", _alerts("PdserveTPOTSLOBudgetFastBurn")),
                             _at("2m", _alerts("PdserveTTFTSLOBudgetFastBurn"))]},  # not for 2m yet
        {"interval": "1m", "input_series": _slo_series(ttft, "2.0", 90),
         "alert_rule_test": [_at("70m", _alerts("PdserveTTFTSLOBudgetFastBurn")),
                             _at("70m", _alerts("PdserveTTFTSLOBudgetSlowBurn", warn_ttft))]},
        {"interval": "1m", "input_series": _slo_series(ttft, "2.0", 995, 1000) + _slo_series(tpot, "0.1", 70),
         "alert_rule_test": [_at("70m", _alerts("PdserveTTFTSLOBudgetFastBurn")),
                             _at("70m", _alerts("PdserveTTFTSLOBudgetSlowBurn")),
                             _at("70m", _alerts("PdserveTPOTSLOBudgetFastBurn", crit_tpot))]},
        {"interval": "1m", "input_series": [
            {"series": _restarts("pdserve-decode-7d9-x2", "decode"), "values": "0+1x30"},
            {"series": _restarts("other-decode-7d9-x2", "decode"), "values": "0+1x30"},  # another release
            {"series": _restarts("pdserve-router-5c-q", "router"), "values": "0x30"},
            {"series": f'pdserve_router_worker_deaths_total{{{_ROUTER},pool="prefill"}}', "values": "0+1x30"},
            {"series": f'pdserve_router_worker_deaths_total{{{_ROUTER},pool="decode"}}', "values": "0x30"},
            {"series": f'pdserve_router_inflight_requests{{{_ROUTER}}}', "values": "0x30"}],
         "alert_rule_test": [
             _at("20m", _alerts("PdservePodCrashLooping", {
                 "namespace": "pdserve", "pod": "pdserve-decode-7d9-x2", "container": "decode",
                 "severity": "warning"})),
             _at("20m", _alerts("PdserveWorkerDying", {**base, "pool": "prefill", "severity": "warning"})),
             _at("20m", _alerts("PdserveRouterAbsent"))]},
        {"interval": "1m", "input_series": [
            {"series": f'pdserve_router_workers{{{_ROUTER},pool="decode",instance="r1"}}', "values": "1x30"},
            {"series": f'pdserve_router_workers{{{_ROUTER},pool="prefill",instance="r1"}}', "values": "0x30"},
            {"series": 'kube_deployment_spec_replicas{namespace="pdserve",deployment="pdserve-decode"}',
             "values": "3x30"},
            {"series": 'kube_deployment_spec_replicas{namespace="pdserve",deployment="pdserve-prefill"}',
             "values": "0x30"}],
         "alert_rule_test": [
             _at("20m", _alerts("PdserveWorkersMissing", {"namespace": "pdserve", "pool": "decode",
                                                          "severity": "warning"})),
             _at("20m", _alerts("PdservePoolEmpty")),  # prefill is at 0 replicas on purpose
             _at("20m", _alerts("PdserveRouterAbsent", {**base, "severity": "critical"}))]},
        {"interval": "1m", "input_series": [
            {"series": f'pdserve_router_workers{{{_ROUTER},pool="decode"}}', "values": "0x30"}],
         "alert_rule_test": [  # no kube-state-metrics: the empty pool still pages
             _at("20m", _alerts("PdservePoolEmpty", {**base, "pool": "decode", "severity": "critical"})),
             _at("1m", _alerts("PdservePoolEmpty"))]},
    ]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"],
                                                        "evaluation_interval": "1m", "tests": tests}))
    run_promtool("test", "rules", str(tmp_path / "tests.yml"))


# ------------------------------------------------------------------------------------- ServiceMonitor


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "NotIn" and labels.get(e["key"]) in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
    return True


@pytest.mark.parametrize("preset,sets", [("gpu", ()), ("default", ("metrics.serviceMonitor.enabled=true",)),
                                         ("kind", ("metrics.serviceMonitor.enabled=true",))])
def test_service_monitor_reaches_every_roles_metrics_port(preset: str, sets: tuple[str, ...]) -> None:
    """Every pod with a metrics container port (router, prefill, decode) sits behind a Service the
    ServiceMonitor selects, whose `metrics` port targets that container port; nothing else is selected."""
    docs = render(preset, sets)
    (sm,) = by_kind(docs, "ServiceMonitor")
    (endpoint,) = sm["spec"]["endpoints"]
    assert sm["spec"]["namespaceSelector"]["matchNames"] == ["pdserve"]
    services = [s for s in by_kind(docs, "Service")
                if _selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    reached = set()
    for dep in by_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]
        ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", []) if p["name"] == "metrics"]
        if not ports:
            continue
        role = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        mine = [s for s in services if s["spec"].get("selector")
                and all(pod["metadata"]["labels"].get(k) == v for k, v in s["spec"]["selector"].items())]
        assert len(mine) == 1, f"{role}: {len(mine)} selected Services in front of its pods"
        (port,) = [p for p in mine[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert port["targetPort"] in ("metrics", ports[0]["containerPort"]), role
        reached.add(role)
    assert reached == {"router", "prefill", "decode"}
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in services} == reached


# ------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("sets,needle", [
    (("monitoring.prometheusRule.slo.objective=1",), "objective"),
    (("monitoring.prometheusRule.fastBurn.longWindow=1hour",), "longWindow"),
    (("monitoring.prometheusRule.crashLoop.restarts=0",), "restarts"),
    (("monitoring.dashboard.label=bad label",), "label"),
    (("monitoring.dashboard.enable=true",), "enable"),
])
def test_schema_rejects_bad_monitoring_values(sets: tuple[str, ...], needle: str) -> None:
    assert needle in render_fails("default", sets)
