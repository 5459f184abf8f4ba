"""The tracing facade: off by default at no cost, configured from OTEL_* only, its drops counted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from disagg_project import telemetry
from disagg_project.telemetry import Tracing, exporters_from_environment, spans_dropped


def test_off_by_default() -> None:
    assert telemetry.tracing.on is False
    assert exporters_from_environment({}) == []
    assert exporters_from_environment({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporters_from_environment({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) == []


def test_off_the_request_span_is_none_and_nothing_is_touched() -> None:
    off = Tracing()
    assert off.start_request("POST /v1/messages", {b"traceparent": b"garbage"}, {}) is None
    assert off.start_linked("batch item", "garbage", {}) is None and off.current_traceparent() == ""
    # Off, the facade never made a tracer: a seam that ignored `on` would fail loudly here.
    assert off._tracer is None and off._propagator is None


def test_the_otlp_exporter_is_http_protobuf_only() -> None:
    [exporter] = exporters_from_environment({"OTEL_TRACES_EXPORTER": "otlp"})
    assert type(exporter).__name__ == "OtlpSpanExporter"  # the official one, our encoder in it (test_otlp_exporter.py)
    with pytest.raises(ValueError, match="http/protobuf"):
        exporters_from_environment({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ValueError, match="zipkin"):
        exporters_from_environment({"OTEL_TRACES_EXPORTER": "zipkin"})


class Failing(SpanExporter):
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


class Collecting(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[Any] = []

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


@pytest.fixture
def on() -> Iterator[tuple[Tracing, Collecting]]:
    exporter = Collecting()
    tracing = Tracing()
    tracing.configure([exporter])
    yield tracing, exporter
    tracing.shutdown()


def test_a_client_trace_is_continued_and_the_worker_call_injects_its_span(on: tuple[Tracing, Collecting]) -> None:
    tracing, exporter = on
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    request = tracing.start_request("POST /v1/messages", {b"traceparent": f"00-{trace_id}-{parent}-01".encode()}, {})
    assert request is not None and request.trace_id == trace_id
    headers: dict[str, str] = {}
    call = tracing.worker_call("context", "POST", "http://10.0.0.7:8001/v1/chat/completions", headers, {})
    span_id = format(call.get_span_context().span_id, "016x")
    assert headers["traceparent"] == f"00-{trace_id}-{span_id}-01"
    tracing.end(call, asyncio.CancelledError())
    tracing.end_request(request, {"gen_ai.request.model": "m"}, "overloaded_error")
    tracing._provider.force_flush()
    by_name = {s.name: s for s in exporter.spans}
    assert by_name["context"].attributes["error.type"] == "cancelled"
    assert by_name["context"].attributes["server.port"] == 8001
    assert by_name["POST /v1/messages"].attributes["error.type"] == "overloaded_error"
    assert by_name["POST /v1/messages"].parent.span_id == int(parent, 16)


class Retaining(SpanExporter):
    """Fails, and keeps what it was given (as a failed export's reference cycles keep its frames)."""

    def __init__(self) -> None:
        self.given: list[Any] = []

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.given.append(spans)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


def test_a_failed_export_holds_no_spans_after_it_returns() -> None:
    retaining = Retaining()
    tracing = Tracing()
    tracing.configure([retaining])
    try:
        for _ in range(3):
            tracing.end(tracing.child("x"))
        tracing._provider.force_flush()
    finally:
        tracing.shutdown()
    assert retaining.given and all(batch == [] for batch in retaining.given)


def test_failed_exports_and_a_full_queue_are_counted() -> None:
    before = spans_dropped.labels("export_failed")._value.get() + spans_dropped.labels("queue_full")._value.get()
    tracing = Tracing()
    tracing.configure([Failing()])
    try:
        for _ in range(3):
            tracing.end(tracing.child("x"))
        tracing._provider.force_flush()
    finally:
        tracing.shutdown()
    after = spans_dropped.labels("export_failed")._value.get() + spans_dropped.labels("queue_full")._value.get()
    assert after - before == 3


def test_the_admin_links_a_traced_request(settings: Any) -> None:
    from django.contrib.admin.sites import site

    from messages_api.admin import MessageRequestAdmin
    from messages_api.models import MessageRequest

    page = MessageRequestAdmin(MessageRequest, site)
    settings.TRACE_URL_TEMPLATE = "http://jaeger:16686/trace/{trace_id}"
    assert 'href="http://jaeger:16686/trace/' + "ab" * 16 + '"' in page.trace(MessageRequest(trace_id="ab" * 16))
    assert "not traced" in page.trace(MessageRequest(trace_id=""))
    settings.TRACE_URL_TEMPLATE = ""
    assert "href" not in page.trace(MessageRequest(trace_id="ab" * 16))
