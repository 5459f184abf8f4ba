"""disagg_project/otlp_exporter.py: the gateway's OTLP/HTTP exporter posts what the official one
posts, byte for byte, to a real receiver (tests/support/otlp_receiver.py), and fails as it does."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context

from disagg_project.otlp_exporter import OtlpSpanExporter
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.ports import refused_url


def gateway_like_spans() -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("disagg_project")
    server = tracer.start_span("POST /v1/messages", kind=SpanKind.SERVER, attributes={"http.route": "/v1/messages"})
    call = tracer.start_span("generation", set_span_in_context(server), kind=SpanKind.CLIENT, attributes={"server.port": 8002})
    call.add_event("gen_ai.first_token")
    call.end()
    server.set_attributes({"gen_ai.usage.output_tokens": 4, "gen_ai.response.finish_reasons": ["end_turn"]})
    server.end()
    return list(memory.get_finished_spans())


def test_it_posts_the_official_exporters_bytes() -> None:
    spans = gateway_like_spans()
    with OtlpReceiver() as receiver:
        for exporter in (OTLPSpanExporter(endpoint=receiver.url + "/v1/traces"), OtlpSpanExporter(endpoint=receiver.url + "/v1/traces")):
            assert exporter.export(spans) is SpanExportResult.SUCCESS
            exporter.shutdown()
        official, ours = receiver.bodies
    assert ours == official
    assert {s.name for s in receiver.spans} == {"POST /v1/messages", "generation"}


def test_an_unreachable_collector_fails_the_export() -> None:
    exporter = OtlpSpanExporter(endpoint=refused_url() + "/v1/traces", timeout=1)
    assert exporter.export(gateway_like_spans()) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert exporter.export([]) is SpanExportResult.FAILURE  # shut down
