"""An API request's OpenTelemetry span: started when its body is complete, ended when its task
ends, its attributes read from the audit record (which already collects them). A batch item's
attempt has one too (`start_batch_item`), at the root of a trace of its own, linked to the span
of the request that created the batch.

    span = request_span.start(scope, headers, record) if tracing.on else None
    ...
    if span is not None: request_span.end(span, record)

Attributes: HTTP and server ones, OpenTelemetry's GenAI conventions (`gen_ai.*`), and the gateway's
own under `gateway.*` (pool, endpoints, stage, queued_ms, cache tokens, the key's name — never the
key — and its priority). No prompt or answer content. A request that failed ends the span in the
error status with Anthropic's error type; one whose client left, with "cancelled".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from disagg_project import RequestSpan, tracing
from messages_api.audit import AuditRecord
from messages_api.models import RequestStatus
from messages_api.request_context import current_trace_id

__all__ = ["end", "start", "start_batch_item"]

# A batch's id in a path, replaced in the span's name (a name is low-cardinality).
_BATCH_ID = re.compile(r"/msgbatch_[A-Za-z0-9]+")

# GenAI's operation name for the routes that generate.
_OPERATIONS = {"/v1/messages": "chat"}


def start(scope: Mapping[str, Any], headers: Mapping[bytes, bytes], record: AuditRecord) -> RequestSpan | None:
    """Start the request's server span (continuing the client's `traceparent`), current in this
    task; note its trace id in the record and the log context when it is sampled."""
    method = str(scope.get("method", ""))
    path = str(scope.get("path", ""))
    route = _BATCH_ID.sub("/{message_batch_id}", path)
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.path": path,
        "http.route": route,
        "gateway.request_id": record.request_id,
    }
    server = scope.get("server")
    if server and server[0]:
        attributes["server.address"] = str(server[0])
        if server[1] is not None:
            attributes["server.port"] = int(server[1])
    operation = _OPERATIONS.get(path)
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
    span = tracing.start_request(f"{method} {route}", headers, attributes)
    if span is not None and span.trace_id:
        record.trace_id = span.trace_id
        current_trace_id.set(span.trace_id)
    return span


def start_batch_item(record: AuditRecord, attempt: int, batch_traceparent: str) -> RequestSpan | None:
    """Start a batch item's attempt as a trace of its own (a CONSUMER span, current in this task),
    linked to the span of the request that created its batch; noted like `start`'s."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gateway.request_id": record.request_id,
        "gateway.batch_id": record.batch_id,
        "gateway.batch.custom_id": record.custom_id,
        "gateway.batch.attempt": attempt,
    }
    span = tracing.start_linked("batch item", batch_traceparent, attributes)
    if span is not None and span.trace_id:
        record.trace_id = span.trace_id
        current_trace_id.set(span.trace_id)
    return span


def end(span: RequestSpan, record: AuditRecord) -> None:
    """End the request's span with what the record holds now."""
    attributes: dict[str, Any] = {}
    if record.http_status is not None:
        attributes["http.response.status_code"] = record.http_status
    if record.model:
        attributes["gen_ai.request.model"] = record.model
        if record.status == RequestStatus.COMPLETED:
            # The gateway answers in the model's name the client asked for.
            attributes["gen_ai.response.model"] = record.model
    _put(attributes, "gen_ai.request.max_tokens", record.max_tokens)
    if record.stop_reason:
        attributes["gen_ai.response.finish_reasons"] = [record.stop_reason]  # Anthropic's stop_reason
    _put(attributes, "gen_ai.usage.input_tokens", record.input_tokens)
    _put(attributes, "gen_ai.usage.output_tokens", record.output_tokens)
    _put(attributes, "gateway.usage.cache_read_input_tokens", record.cache_read_input_tokens)
    _put(attributes, "gateway.usage.cache_creation_input_tokens", record.cache_creation_input_tokens)
    _put(attributes, "gateway.queued_ms", record.queued_ms)
    for name, value in (
        ("gateway.pool", record.pool_name),
        ("gateway.endpoint.context", record.context_endpoint),
        ("gateway.endpoint.generation", record.generation_endpoint),
        ("gateway.api_key.name", record.api_key_name),
        ("gateway.priority", record.priority.label if record.priority is not None else ""),
        ("gateway.batch_id", record.batch_id),
    ):
        if value:
            attributes[name] = value
    attributes["gateway.stage"] = record.stage
    attributes["gateway.status"] = record.status
    attributes["gateway.stream"] = record.stream
    if record.run is not None:
        # The schedule the pool ran (context first, generation first, ...), and its engine.
        pool = getattr(record.run, "pool", None)
        if pool is not None:
            attributes["gateway.schedule"] = pool.schedule_style
            attributes["gen_ai.provider.name"] = pool.protocol
    error_type = record.error_type
    if not error_type and (record.status == RequestStatus.CANCELLED or not record.ended):
        error_type = "cancelled"  # the client left (a record never begun is never ended)
    tracing.end_request(span, attributes, error_type)


def _put(attributes: dict[str, Any], name: str, value: int | float | None) -> None:
    if value is not None:
        attributes[name] = value
