"""Prometheus metrics of the front door, observed once per request when its audit row ends.

A traced request (its trace sampled) gives the time-to-first-token and duration histograms its
trace id as an exemplar (`{trace_id="…"}`), served with the OpenMetrics exposition
(messages_api/views.py): a dashboard jumps from a slow bucket to the trace. An untraced request's
observation carries none and costs nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.conf import settings
from prometheus_client import Counter, Gauge, Histogram

from messages_api.errors import ERROR_TYPE_BY_STATUS, STATUS_BY_ERROR_TYPE

if TYPE_CHECKING:
    from messages_api.audit import AuditRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

requests = Counter("gateway_requests", "Requests by terminal status and the stage they ended in.", ["status", "stage", "stream"])
# Bounded labels: Anthropic's error types (any other is counted as "other"), and the stages.
_ERROR_TYPES = frozenset(ERROR_TYPE_BY_STATUS.values()) | frozenset(STATUS_BY_ERROR_TYPE)
errors = Counter(
    "gateway_errors", "Requests that ended with an error, by Anthropic error type and the stage they ended in.", ["type", "stage"]
)
time_to_status_line = Histogram(
    "gateway_time_to_status_line_seconds", "Streamed requests: receipt to response headers.", buckets=_LATENCY_BUCKETS
)
time_to_first_token = Histogram(
    "gateway_time_to_first_token_seconds", "Receipt to the first generated chunk.", buckets=_LATENCY_BUCKETS
)
request_duration = Histogram(
    "gateway_request_duration_seconds", "Accepted requests: receipt to the end (the last byte, the failure, or the client gone).",
    buckets=_LATENCY_BUCKETS,
)
context_phase = Histogram("gateway_context_phase_seconds", "Receipt to the context phase's answer.", buckets=_LATENCY_BUCKETS)
generation_phase = Histogram(
    "gateway_generation_phase_seconds", "Context done (or receipt) to the end of the generation stream.", buckets=_LATENCY_BUCKETS
)
open_streams = Gauge("gateway_open_streams", "Streamed responses currently open.")
pings_sent = Counter("gateway_pings_sent", "Ping events sent on silent streams.")
unauthenticated_rejections = Counter(
    "gateway_unauthenticated_rejections",
    "Requests refused without a valid API key (only a sample of them is written to the audit).",
)

# Per API key, only with METRICS_PER_KEY_LABELS (one series per key: the operator's choice).
key_requests = Counter("gateway_key_requests", "Requests per API key by terminal status (METRICS_PER_KEY_LABELS).", ["key", "status"])
key_tokens = Counter(
    "gateway_key_tokens", "Tokens per API key: input, output, cache_read (METRICS_PER_KEY_LABELS).", ["key", "kind"]
)

# Message Batches (messages_api/batches/runner.py). The two gauges are the whole database's items
# (every process's sweep sets them to the same count: aggregate them with max, not sum).
batch_items = Counter("gateway_batch_items", "Batch items ended, by result (succeeded, errored, canceled, expired).", ["result"])
batch_retries = Counter(
    "gateway_batch_item_retries", "Batch item attempts given back to the queue to try again, by the error that refused them.", ["type"]
)
batch_items_waiting = Gauge("gateway_batch_items_waiting", "Batch items queued to run, in all batches in progress (the batch depth).")
batch_items_running = Gauge("gateway_batch_items_running", "Batch items held by a gateway process's lease, running.")


def observe(record: AuditRecord) -> None:
    exemplar = {"trace_id": record.trace_id} if record.trace_id else None
    _child(requests, record.status, record.stage or "received", "true" if record.stream else "false").inc()
    if record.error_type:
        error_type = record.error_type if record.error_type in _ERROR_TYPES else "other"
        _child(errors, error_type, record.stage or "received").inc()
    if record.headers_sent_ms is not None and record.stream:
        time_to_status_line.observe(record.headers_sent_ms / 1000)
    if record.first_token_ms is not None:
        time_to_first_token.observe(record.first_token_ms / 1000, exemplar)
    if record.context_done_ms is not None:
        context_phase.observe(record.context_done_ms / 1000)
    if record.finished_ms is not None and record.first_token_ms is not None:
        generation_phase.observe((record.finished_ms - (record.context_done_ms or 0)) / 1000)
    if record.begun and record.finished_ms is not None:
        request_duration.observe(record.finished_ms / 1000, exemplar)
    if record.pings_sent:
        pings_sent.inc(record.pings_sent)
    if record.api_key_name and settings.METRICS_PER_KEY_LABELS:
        _observe_key(record)


# The labelled children by (metric, label values): `labels()` costs a lock and a few µs, per
# request; the label sets are few (statuses × stages, keys × kinds).
_children: dict[tuple[Any, ...], Any] = {}


def _child(metric: Counter, *labels: str) -> Any:
    child = _children.get((metric, *labels))
    if child is None:
        child = _children[(metric, *labels)] = metric.labels(*labels)
    return child


def _observe_key(record: AuditRecord) -> None:
    key = record.api_key_name
    _child(key_requests, key, record.status).inc()
    if record.input_tokens:
        _child(key_tokens, key, "input").inc(record.input_tokens)
    if record.output_tokens:
        _child(key_tokens, key, "output").inc(record.output_tokens)
    if record.cache_read_input_tokens:
        _child(key_tokens, key, "cache_read").inc(record.cache_read_input_tokens)
