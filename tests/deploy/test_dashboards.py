"""The Grafana dashboard (deploy/dashboards/dra-gpu.json) and the chart's PrometheusRule: every
PromQL expression parses (promql-parser: the Rust promql-parser crate, as GreptimeDB uses it) and
names only series the kubelet plugin and the webhook export, with their labels."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from dra_gpu.controller.webhook import Metrics as WebhookMetrics
from dra_gpu.health.manager import HealthMetrics
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from tests.deploy.conftest import Render, one

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "dashboards" / "dra-gpu.json"
# Labels Prometheus adds to every scraped series (the scrape target's), not the code.
TARGET_LABELS = {"instance", "job"}
# The dashboard's variables, as Grafana substitutes them.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*"}
MAX_DEPTH = 64  # of a PromQL expression's tree


def exported_series() -> dict[str, set[str]]:
    """Series name -> its label names, as /metrics of the plugin and of the webhook show them:
    every labelled metric given one child, then the exposition text parsed back."""
    plugin = PluginMetrics()
    health = HealthMetrics(plugin.registry)  # the plugin registers the health monitor's in its own
    webhook = WebhookMetrics()
    series: dict[str, set[str]] = {}
    holders: list[tuple[list[object], CollectorRegistry]] = [
        ([plugin, health], plugin.registry),
        ([webhook], webhook.registry),
    ]
    for objects, registry in holders:
        metrics = [m for o in objects for m in vars(o).values()]
        for metric in metrics:
            if isinstance(metric, MetricWrapperBase) and metric._labelnames:  # no sample until a child exists
                metric.labels(*("x" for _ in metric._labelnames))
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


SERIES = exported_series()


def selectors(node: Any, depth: int = 0) -> Iterator[Any]:
    """The VectorSelectors of a parsed expression (inside matrices, calls, aggregations, ...)."""
    assert depth < MAX_DEPTH, "expression nested too deeply"
    if isinstance(node, promql_parser.VectorSelector):
        yield node
        return
    if isinstance(node, promql_parser.MatrixSelector):
        yield node.vector_selector
        return
    for child in ("expr", "lhs", "rhs", "param"):
        value = getattr(node, child, None)
        if value is not None:
            yield from selectors(value, depth + 1)
    for arg in getattr(node, "args", None) or []:
        yield from selectors(arg, depth + 1)


def problems_of(expr: str) -> list[str]:
    """What is wrong with one expression: it does not parse, or names a series or label the code
    does not export."""
    try:
        tree = promql_parser.parse(expr)
    except ValueError as exc:
        return [f"{expr!r}: does not parse: {exc}"]
    out = []
    found = list(selectors(tree))
    if not found:
        out.append(f"{expr!r}: names no metric")
    for vs in found:
        if vs.name not in SERIES:
            out.append(f"{expr!r}: {vs.name!r} is not a series the plugin or the webhook exports")
            continue
        for m in vs.matchers.matchers:
            if m.name not in SERIES[vs.name] | TARGET_LABELS:
                out.append(f"{expr!r}: {vs.name} has no label {m.name!r} (it has {sorted(SERIES[vs.name])})")
    return out


def substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return expr


def dashboard_expressions(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield substitute(value)
            else:
                yield from dashboard_expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_expressions(item)


def test_the_code_exports_what_the_checks_compare_against() -> None:
    assert SERIES["dra_gpu_node_requests_total"] == {"operation", "result"}
    assert "le" in SERIES["dra_gpu_admission_duration_seconds_bucket"]
    assert SERIES["dra_gpu_device_healthy"] == {"device"}


def test_the_checks_catch_a_wrong_name_label_or_syntax() -> None:
    assert problems_of("sum(rate(dra_gpu_node_requests_total[5m]))") == []
    assert "not a series" in problems_of("rate(dra_gpu_node_request_total[5m])")[0]
    assert "no label 'node'" in problems_of('dra_gpu_device_healthy{node="a"}')[0]
    assert "does not parse" in problems_of("sum(rate(dra_gpu_device_healthy[5m])")[0]


def test_every_dashboard_query_parses_and_names_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(dashboard_expressions(dashboard["panels"]))
    assert len(exprs) >= 20
    assert [p for e in exprs for p in problems_of(e)] == []
    # Every metric the code exports is on the dashboard (the _created series aside).
    shown = {vs.name for e in exprs for vs in selectors(promql_parser.parse(e))}
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in SERIES if not n.endswith("_created")}
    assert families - {re.sub(r"_bucket$", "", n) for n in shown} == set()
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"]).groups()  # type: ignore[union-attr]
            assert metric in SERIES and label in SERIES[metric] | TARGET_LABELS


def test_prometheus_rule_is_off_by_default_and_its_alerts_parse(render: Render) -> None:
    assert not [o for o in render() if o["kind"] == "PrometheusRule"]
    rule = one(render("prometheusRule.enabled=true", "prometheusRule.labels.release=prom"), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"DraGpuDeviceTainted", "DraGpuPrepareErrors", "DraGpuWebhookFailing"} <= set(alerts)
    assert [p for r in alerts.values() for p in problems_of(r["expr"])] == []
    for r in alerts.values():
        assert r["labels"]["severity"] and r["annotations"]["summary"], r["alert"]
