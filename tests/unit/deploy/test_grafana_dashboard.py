"""deploy/grafana/disagg-gateway.json is built on what the gateway exports: every metric a query (or
a template variable) names is in the live Prometheus registry once the metric modules are
imported, with the suffixes the client library gives it (`_total` for counters, `_bucket`,
`_sum`, `_count` for histograms), and every label a query filters or groups by is one of that
metric's labels (or one Prometheus adds at scrape: `instance`, `job`)."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "disagg-gateway.json"
# Where the gateway defines its metrics (imported here, as a gateway process imports them).
METRIC_MODULES = (
    "messages_api.metrics",
    "messages_api.server.loop_lag",
    "messages_api.server.http_guard",
    "workers.cluster.metrics",
    "disagg_project.shared_state",
    "workers.admission.queue",
)
SCRAPE_LABELS = {"instance", "job"}
SUFFIXES = {
    "counter": {"_total": (), "_created": ()},
    "gauge": {"": ()},
    "histogram": {"_bucket": ("le",), "_sum": (), "_count": (), "_created": ()},
    "summary": {"": ("quantile",), "_sum": (), "_count": (), "_created": ()},
    "info": {"_info": ()},
    "stateset": {"": ()},
    "unknown": {"": ()},
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf", "nan"}
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


def exported() -> dict[str, set[str]]:
    """Sample name → its label names, for everything the default registry exports."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    names: dict[str, set[str]] = {}

    def add(name: str, kind: str, labels: Any) -> None:
        for suffix, extra in SUFFIXES.get(kind, {"": ()}).items():
            names.setdefault(name + suffix, set()).update(labels, extra)

    for collector in list(REGISTRY._collector_to_names):  # the registry's collectors (no public list)
        if isinstance(collector, MetricWrapperBase):
            for family in collector.describe():
                add(family.name, family.type, collector._labelnames)
            continue
        for family in collector.collect():
            add(family.name, family.type, getattr(family, "_labelnames", ()))
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def queries(node: Any) -> Iterator[str]:
    """Every PromQL expression in the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "definition" and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def parse(expr: str) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(metric names, labels matched per metric, labels grouped by) of one expression."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana's variables
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges
    grouped = {label.strip() for group in re.findall(GROUPING, e) for label in group.split(",") if label.strip()}
    e = re.sub(GROUPING, " ", e)
    matched: dict[str, set[str]] = {}
    for name, inside in re.findall(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}", e):
        matched.setdefault(name, set()).update(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", inside))
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b", " ", e)
    names = set()
    for token in re.finditer(r"[A-Za-z_:][\w:]*", e):
        if e[token.end():].lstrip().startswith("("):
            continue  # a function or aggregation
        if token.group().lower() in PROMQL_WORDS:
            continue
        names.add(token.group())
    if expr.strip().startswith("label_values("):  # label_values(metric, label)
        metric, _, label = expr.strip()[len("label_values("):-1].partition(",")
        names, grouped = {metric.strip()}, {label.strip()}
    return names, matched, grouped


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def test_every_query_names_a_metric_the_gateway_exports(dashboard: dict[str, Any]) -> None:
    known = exported()
    assert "gateway_requests_total" in known and "gateway_time_to_first_token_seconds_bucket" in known
    expressions = list(queries(dashboard))
    assert len(expressions) > 20
    unknown, bad_labels = [], []
    for expr in expressions:
        names, matched, grouped = parse(expr)
        assert names, f"no metric found in {expr!r}"
        for name in names:
            if name not in known:
                unknown.append((name, expr))
        labels_of_expr = set().union(*(known.get(n, set()) for n in names)) | SCRAPE_LABELS
        for name, labels in matched.items():
            allowed = (known.get(name, set()) if name else labels_of_expr) | SCRAPE_LABELS
            bad_labels += [(label, name, expr) for label in labels - allowed]
        bad_labels += [(label, "grouping", expr) for label in grouped - labels_of_expr]
    assert unknown == [], "metrics the gateway does not export"
    assert bad_labels == [], "labels those metrics do not have"


def test_the_parser_finds_names_and_labels() -> None:
    """The check above is live: it sees metric names, matchers and groupings, and skips functions."""
    names, matched, grouped = parse(
        "histogram_quantile(0.99, sum by (le, priority) "
        '(rate(gateway_admission_wait_seconds_bucket{instance=~"$instance", outcome="admitted"}[$__rate_interval])))'
        " / on(instance) gateway_open_streams"
    )
    assert names == {"gateway_admission_wait_seconds_bucket", "gateway_open_streams"}
    assert matched == {"gateway_admission_wait_seconds_bucket": {"instance", "outcome"}}
    assert grouped == {"le", "priority", "instance"}
    assert parse("label_values(gateway_endpoint_healthy, pool)") == ({"gateway_endpoint_healthy"}, {}, {"pool"})
    assert "gateway_no_such_metric_total" not in exported()


def test_the_dashboard_covers_the_asked_for_ground(dashboard: dict[str, Any]) -> None:
    text = " ".join(queries(dashboard))
    for metric in (
        "gateway_requests_total", "gateway_errors_total", "gateway_time_to_first_token_seconds_bucket", "gateway_pings_sent_total",
        "gateway_open_streams", "gateway_endpoint_healthy", "gateway_breaker_state", "gateway_open_reservations",
        "gateway_admission_queue_depth", "gateway_admission_wait_seconds_bucket", "gateway_shared_state_fallbacks_total",
        "gateway_event_loop_lag_seconds",
    ):  # fmt: skip
        assert metric in text, metric


def test_the_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        box = panel["gridPos"]
        assert 0 <= box["x"] and box["x"] + box["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "instance", "pool"}
    assert dashboard["uid"] == "disagg-gateway"


def test_errors_are_counted_by_type_and_stage() -> None:
    """gateway_errors_total, which the dashboard's "errors by type" panel reads; an error type
    outside Anthropic's list (none is expected) is counted as "other", so the labels stay few."""
    from messages_api import metrics
    from messages_api.audit import AuditRecord

    def count(error_type: str, stage: str) -> float:
        return REGISTRY.get_sample_value("gateway_errors_total", {"type": error_type, "stage": stage}) or 0.0

    before = count("overloaded_error", "context"), count("other", "generation")
    metrics.observe(AuditRecord(status="failed", stage="context", error_type="overloaded_error"))
    metrics.observe(AuditRecord(status="failed", stage="generation", error_type="made_up_error"))
    metrics.observe(AuditRecord(status="completed", stage="done"))
    assert (count("overloaded_error", "context"), count("other", "generation")) == (before[0] + 1, before[1] + 1)
    assert REGISTRY.get_sample_value("gateway_errors_total", {"type": "made_up_error", "stage": "generation"}) is None


def test_the_latency_panels_show_the_exemplars_that_link_to_traces(dashboard: dict[str, Any]) -> None:
    """The time-to-first-token and duration histograms carry trace-id exemplars (messages_api/metrics.py):
    each panel asks for them on one query, so Grafana draws them and links them to the trace."""
    for metric in ("gateway_time_to_first_token_seconds_bucket", "gateway_request_duration_seconds_bucket"):
        targets = [t for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"] if metric in t["expr"]]
        assert [t["refId"] for t in targets if t.get("exemplar")], metric
