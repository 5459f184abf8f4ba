"""disagg_project/otlp_encoding.py: for any batch of spans, the very bytes of the official OTLP
encoder (`opentelemetry-exporter-otlp-proto-common`'s `encode_spans`, serialized by
`opentelemetry-proto`'s messages), which the official parser therefore reads back the same."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as official_encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from disagg_project.otlp_encoding import encode_spans

# Any string, surrogates included (protobuf refuses those: the attribute is dropped).
any_text = st.text(st.characters(codec=None, categories=None), max_size=20) | st.text(max_size=300)
# What an attribute can hold: OTLP's scalars, arrays, maps, and what OTLP cannot hold (an int past
# int64, a type it has no value for).
scalars = (
    st.none()
    | st.booleans()
    | any_text
    | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.binary(max_size=20)
    | st.text("a€", min_size=5000, max_size=6000)  # past 16 KiB of UTF-8: a three-byte length
)
values = st.recursive(
    scalars | st.builds(object),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)
# Attribute keys: the gateway's kind, and any.
keys = st.sampled_from(["gen_ai.request.model", "gateway.pool", "http.route", ""]) | any_text
attribute_dicts = st.dictionaries(keys, values, max_size=6)


@st.composite
def attributes(draw: st.DrawFn) -> Any:
    """A plain mapping, or the SDK's bounded one (whose drops are encoded), or nothing."""
    raw = draw(attribute_dicts)
    kind = draw(st.sampled_from(["dict", "bounded", "none"]))
    if kind == "none":
        return None
    if kind == "dict":
        return raw
    return BoundedAttributes(maxlen=draw(st.none() | st.integers(0, 4)), attributes=raw, immutable=True)


trace_state_key = st.from_regex(r"\A[a-z][a-z0-9_*/-]{0,8}\Z")
trace_state_value = st.from_regex(r"\A[!-+\--<>-~]{1,8}\Z")
trace_states = st.dictionaries(trace_state_key, trace_state_value, max_size=3).map(lambda d: TraceState(list(d.items())))


@st.composite
def span_contexts(draw: st.DrawFn) -> SpanContext:
    return SpanContext(
        trace_id=draw(st.integers(0, (1 << 128) - 1)),
        span_id=draw(st.integers(0, (1 << 64) - 1)),
        is_remote=draw(st.booleans()),
        trace_flags=TraceFlags(draw(st.integers(0, 255))),
        trace_state=draw(trace_states),
    )


times = st.none() | st.integers(0, (1 << 64) - 1)
statuses = st.none() | st.builds(Status, st.sampled_from(list(StatusCode)), st.none() | any_text)
events = st.builds(Event, name=any_text, attributes=attributes(), timestamp=st.integers(0, (1 << 64) - 1))
links = st.builds(Link, context=span_contexts(), attributes=attributes())


@st.composite
def bounded_lists(draw: st.DrawFn, elements: st.SearchStrategy[Any]) -> Any:
    """A plain list, or the SDK's bounded one (whose drops are encoded)."""
    items = draw(st.lists(elements, max_size=3))
    if draw(st.booleans()):
        return items
    return BoundedList.from_seq(draw(st.integers(0, 2)), items)


@st.composite
def resources(draw: st.DrawFn) -> Resource:
    raw = draw(st.dictionaries(keys, st.one_of(st.booleans(), st.text(max_size=10), st.integers(0, 9)), max_size=3))
    return Resource(raw, draw(st.sampled_from(["", "https://opentelemetry.io/schemas/1.4.0"])))


scopes = st.none() | st.builds(
    InstrumentationScope,
    name=st.sampled_from(["disagg_project", "other", ""]),
    version=st.none() | st.sampled_from(["1.0", ""]),
    schema_url=st.none() | st.sampled_from(["", "https://opentelemetry.io/schemas/1.4.0"]),
    attributes=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)


@st.composite
def batches(draw: st.DrawFn) -> list[ReadableSpan]:
    # A few resources and scopes, shared by identity or only by value, as spans from a provider
    # or from several would have them.
    resource_pool = draw(st.lists(resources(), min_size=1, max_size=3))
    scope_pool = draw(st.lists(scopes, min_size=1, max_size=3))
    spans = []
    for _ in range(draw(st.integers(0, 5))):
        spans.append(
            ReadableSpan(
                name=draw(any_text),
                context=draw(span_contexts()),
                parent=draw(st.none() | span_contexts()),
                resource=draw(st.sampled_from(resource_pool)),
                attributes=draw(attributes()),
                events=draw(bounded_lists(events)),
                links=draw(bounded_lists(links)),
                kind=draw(st.sampled_from(list(SpanKind))),
                status=draw(statuses),
                start_time=draw(times),
                end_time=draw(times),
                instrumentation_scope=draw(st.sampled_from(scope_pool)),
            )
        )
    return spans


def official(spans: list[ReadableSpan]) -> bytes:
    serialized: bytes = official_encode_spans(spans).SerializePartialToString()
    return serialized


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_any_batch_encodes_to_the_official_encoders_bytes(spans: list[ReadableSpan]) -> None:
    try:
        expected = official(spans)
    except Exception as error:  # a span's name that protobuf cannot hold: both refuse the batch
        with pytest.raises(type(error)):
            encode_spans(spans)
        return
    assert encode_spans(spans) == expected
    assert encode_spans(spans) == expected  # again: its short strings' attributes now from the cache


@given(st.floats(allow_nan=True) | st.integers(-(1 << 63), (1 << 63) - 1) | st.booleans() | st.text())
def test_a_value_reads_back_as_the_official_parser_reads_it(value: Any) -> None:
    span = ReadableSpan(name="s", context=SpanContext(1, 2, False), attributes={"k": value}, start_time=1, end_time=2)
    [read] = ExportTraceServiceRequest.FromString(encode_spans([span])).resource_spans[0].scope_spans[0].spans
    any_value = read.attributes[0].value
    got = getattr(any_value, any_value.WhichOneof("value"))
    assert got == value or (isinstance(value, float) and math.isnan(value) and math.isnan(got))


def test_a_batch_of_the_gateways_spans_from_the_sdk_encodes_the_same() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("disagg_project")
    server = tracer.start_span("POST /v1/messages", kind=SpanKind.SERVER, attributes={"http.route": "/v1/messages", "server.port": 8000})
    from opentelemetry.trace import set_span_in_context

    parent = set_span_in_context(server)
    call = tracer.start_span("generation", parent, kind=SpanKind.CLIENT, attributes={"server.address": "10.0.0.2"})
    call.add_event("gen_ai.first_token")
    call.set_status(Status(StatusCode.ERROR, "cancelled"))
    call.end()
    server.set_attributes({"gen_ai.response.finish_reasons": ["end_turn"], "gateway.queued_ms": 0.5, "gateway.stream": False})
    server.end()
    spans = list(exporter.get_finished_spans())
    assert len(spans) == 2 and encode_spans(spans) == official(spans)


def test_a_key_past_16_kib_with_a_short_value_encodes_the_same_twice() -> None:
    """The cache of short strings' KeyValues takes no KeyValue whose length needs three bytes."""
    span = ReadableSpan(name="s", context=SpanContext(1, 2, False), attributes={"k" * 20000: "v", "x": "y"}, start_time=1, end_time=2)
    assert encode_spans([span]) == official([span])
    assert encode_spans([span]) == official([span])
