"""OpenTelemetry tracing: a thin seam, off unless configured, with one facade object (`tracing`) that
both apps use.

    span = tracing.start_request("POST /v1/messages", headers)  # None when off: nothing else runs
    ...                                                          # children parent on it (contextvars)
    tracing.end_request(span, attributes, error_type="")

    item = tracing.start_linked("batch item", batch_traceparent, attributes)  # a trace of its own, linked

Configured the OpenTelemetry way, from the standard environment variables, read once by
`install()` (a daphne hook, disagg_project/daphne.py):

    OTEL_TRACES_EXPORTER        otlp | console | none (default: none, tracing off); a comma list
    OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION
    OTEL_EXPORTER_OTLP_PROTOCOL http/protobuf only (the exporter this project installs)
    OTEL_TRACES_SAMPLER, _ARG   the SDK's samplers (default parentbased_always_on)
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_MAX_EXPORT_BATCH_SIZE
    OTEL_SDK_DISABLED=true      off, whatever else is set

The contract with the seams:
- Off (the default), `tracing.on` is False and every seam checks it first: no tracer call, no
  header parsed, no allocation. `start_request` returns None, so a request checks the flag once.
- On, spans leave through the SDK's `BatchSpanProcessor`: a bounded queue, exported in batches
  from its own thread, so neither the event loop nor a request waits on the exporter. A full queue
  drops spans, and an export that fails loses its batch: both are counted in
  `gateway_trace_spans_dropped_total{reason}`. The OTLP exporter is the official one with the
  batches encoded by disagg_project/otlp_encoding.py (the official encoder's bytes, a third of
  its CPU: disagg_project/otlp_exporter.py).
- A client's W3C `traceparent`/`tracestate` is continued; without one, a new trace starts (subject
  to the sampler). Every worker request carries a `traceparent` naming the gateway's client span.
- The current span travels in OpenTelemetry's context (a contextvar), so a child task started by
  the request (the generation request's own task) parents on it. Callbacks that run outside the
  request's task (a worker connection's receive callback) must be handed the span instead.
- Nothing here runs per token. No prompt or answer content is recorded unless the operator opts
  in (TRACE_RECORD_CONTENT, messages_api/trace_content.py, through `annotate`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter

__all__ = ["exporters_from_environment", "install", "RequestSpan", "Span", "spans_dropped", "tracing", "Tracing"]

logger = logging.getLogger(__name__)

spans_dropped = Counter(
    "gateway_trace_spans_dropped",
    "Spans lost before export: the export queue was full (queue_full), an export failed "
    "(export_failed), or the processor was already shut down (already_shutdown).",
    ["reason"],
)

#: What the seams hold: an OpenTelemetry span (`opentelemetry.trace.Span`), typed loosely so that a
#: module using the facade imports nothing of OpenTelemetry's.
Span = Any

# Attribute values OpenTelemetry takes.
AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float] | Sequence[bool]


class RequestSpan:
    """A request's server span, made current in the request's context until `end_request`."""

    __slots__ = ("span", "_token", "trace_id")

    def __init__(self, span: Span, token: contextvars.Token[Context], trace_id: str) -> None:
        self.span = span
        self._token = token
        #: 32 hex digits when the span is sampled (it will be exported), else "".
        self.trace_id = trace_id


class _HeaderGetter:
    """W3C fields from an ASGI header dict (lower-case bytes names to bytes values)."""

    def get(self, carrier: Mapping[bytes, bytes], key: str) -> list[str] | None:
        value = carrier.get(key.encode("latin-1"))
        return [value.decode("latin-1")] if value is not None else None

    def keys(self, carrier: Mapping[bytes, bytes]) -> list[str]:
        return [name.decode("latin-1") for name in carrier]


class Tracing:
    """The facade: `on`, then the calls the seams make when it is True."""

    def __init__(self) -> None:
        #: Checked by every seam before anything else; set once by `install()`.
        self.on = False
        self._tracer: Any = None
        self._propagator: Any = None
        self._getter = _HeaderGetter()
        self._provider: Any = None

    # --- the request ---------------------------------------------------------------------------

    def start_request(self, name: str, headers: Mapping[bytes, bytes], attributes: Mapping[str, AttributeValue]) -> RequestSpan | None:
        """Start the request's SERVER span, continuing the client's trace if it sent one, and make
        it current in the calling task's context; None when tracing is off."""
        if not self.on:
            return None
        parent = self._propagator.extract(headers, getter=self._getter) if b"traceparent" in headers else None
        span = self._tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        span_context = span.get_span_context()
        trace_id = format(span_context.trace_id, "032x") if span_context.trace_flags.sampled else ""
        return RequestSpan(span, token, trace_id)

    def start_linked(self, name: str, link: str, attributes: Mapping[str, AttributeValue]) -> RequestSpan | None:
        """Start a CONSUMER span at the root of a trace of its own (a unit of work taken from a
        queue: a batch item), linked to the span whose W3C `traceparent` is `link` (the batch's
        creation; none when "") and made current like `start_request`'s; None when tracing is off."""
        if not self.on:
            return None
        links = []
        if link:
            linked = trace.get_current_span(self._propagator.extract({"traceparent": link})).get_span_context()
            if linked.is_valid:
                links.append(trace.Link(linked))
        root = Context()  # not the caller's current span: a trace of its own
        span = self._tracer.start_span(name, context=root, kind=trace.SpanKind.CONSUMER, attributes=attributes, links=links)
        token = otel_context.attach(trace.set_span_in_context(span, root))
        span_context = span.get_span_context()
        trace_id = format(span_context.trace_id, "032x") if span_context.trace_flags.sampled else ""
        return RequestSpan(span, token, trace_id)

    def current_traceparent(self) -> str:
        """The current span's W3C `traceparent` ("" when tracing is off or no span is current): what
        a unit of work started later, elsewhere, links to (`start_linked`)."""
        if not self.on:
            return ""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return carrier.get("traceparent", "")

    def end_request(self, request: RequestSpan, attributes: Mapping[str, AttributeValue], error_type: str = "") -> None:
        """End the request's span with `attributes`; a non-empty `error_type` (Anthropic's, or
        "cancelled") sets the error status. Detaches the span from the context."""
        span = request.span
        try:
            if span.is_recording():
                span.set_attributes(attributes)
                if error_type:
                    _fail(span, error_type)
            span.end()
        finally:
            otel_context.detach(request._token)

    def annotate(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Set `attributes` on the current span (the request's, in its task), if it records."""
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(attributes)

    def request_error(self, request: RequestSpan | None, error_type: str) -> None:
        """Mark the request's span failed with Anthropic's `error_type` (the error boundary)."""
        if request is not None and request.span.is_recording():
            _fail(request.span, error_type)

    # --- children --------------------------------------------------------------------------------

    def worker_call(
        self, name: str, method: str, url: str, headers: MutableMapping[str, str], attributes: Mapping[str, AttributeValue] | None = None
    ) -> Span:
        """Start a CLIENT span (a child of the current one) for a worker request and put its
        `traceparent` (and the trace's `tracestate`) into `headers`, so the engine's spans join the
        trace under it. End it with `end`."""
        # One attribute dict at the start: each attribute set later costs a lock and a check.
        start = {**_server_of(url), "http.request.method": method}
        if attributes:
            start.update(attributes)
        span = self._tracer.start_span(name, kind=trace.SpanKind.CLIENT, attributes=start)
        self._propagator.inject(headers, context=trace.set_span_in_context(span))
        return span

    def child(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Span:
        """Start an INTERNAL span, a child of the current one, without making it current."""
        return self._tracer.start_span(name, attributes=attributes)

    def past_child(self, name: str, seconds: float, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        """Record an INTERNAL child span that ended now after lasting `seconds` (a wait measured
        by the caller: the span costs nothing unless there was one)."""
        end = time.time_ns()
        span = self._tracer.start_span(name, attributes=attributes, start_time=end - int(seconds * 1e9))
        span.end(end_time=end)

    def event(self, span: Span, name: str) -> None:
        """Add the event `name`, timestamped now, to `span`."""
        span.add_event(name)

    def end(self, span: Span, error: BaseException | str | None = None) -> None:
        """End `span`; with `error`, in the error status, `error.type` naming it (a string as it
        is; for an exception "cancelled" for a cancellation, else the exception's class)."""
        if error and span.is_recording():
            _fail(span, error if isinstance(error, str) else _error_type(error))
        span.end()

    # --- configuration -------------------------------------------------------------------------

    def configure(self, exporters: Sequence[Any]) -> None:
        """Turn tracing on with these span exporters, each behind its own batch processor (the
        sampler, resource and batch sizes from the environment). Used by `install()` and tests."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider(resource=Resource.create())
        for exporter in exporters:
            provider.add_span_processor(_counted_batch_processor(exporter))
        self._provider = provider
        self._tracer = provider.get_tracer("disagg_project")
        self._propagator = TraceContextTextMapPropagator()
        self.on = True

    def shutdown(self) -> None:
        """Export what is queued (within the processors' timeouts) and turn tracing off."""
        provider, self._provider = self._provider, None
        self.on = False
        if provider is not None:
            provider.shutdown()


tracing = Tracing()


def _fail(span: Span, error_type: str) -> None:
    span.set_status(Status(StatusCode.ERROR, error_type))
    span.set_attribute("error.type", error_type)


def _error_type(error: BaseException) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    return type(error).__name__


@functools.lru_cache(maxsize=256)
def _server_of(url: str) -> dict[str, AttributeValue]:
    """A worker URL's `server.*` attributes (cached: a pool has few endpoints). Not to be changed."""
    parts = urlsplit(url)
    attributes: dict[str, AttributeValue] = {"server.address": parts.hostname or ""}
    if parts.port is not None:
        attributes["server.port"] = parts.port
    return attributes


# --- the exporters, and their drops counted ------------------------------------------------------


class _DropCounter:
    """The batch processor's own metrics hook (`ProcessorMetricsT` in the SDK's
    `_shared_internal`), counting what it drops into Prometheus instead of an OpenTelemetry meter."""

    def register_queue_size(self, get_queue_size: Any) -> None:
        pass

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        spans_dropped.labels(error_type).inc(count)

    def finish_items(self, count: int) -> None:
        pass


def _counted_batch_processor(exporter: Any) -> Any:
    """A `BatchSpanProcessor` (bounded queue, its own export thread) whose drops are counted: a full
    queue through the processor's metrics hook (an SDK internal: disagg_project/relied_on.py), a
    failed export by the exporter's wrapper."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    processor = BatchSpanProcessor(_CountingExporter(exporter))
    # The SDK reports a full queue only to an OpenTelemetry meter (and a warning log line per burst).
    processor._batch_processor._metrics = _DropCounter()
    return processor


class _CountingExporter(SpanExporter):
    """A span exporter whose failed exports are counted as dropped spans."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        # A failed export leaves reference cycles behind (its retries' exceptions, their tracebacks
        # holding the export's frames, and through them the frames of this call and its caller),
        # which only a full garbage collection frees, and the gateway's are rare: each held its
        # batch of spans. So the batch is emptied when the export returns (the processor reads it
        # no more: disagg_project/relied_on.py); with the collector down, memory grew ~13 MiB a
        # minute without this (bench/trace_exporter_down.py).
        count = len(spans)
        try:
            result = self._exporter.export(spans)
        except Exception:
            spans_dropped.labels("export_failed").inc(count)
            raise
        finally:
            if isinstance(spans, list):
                spans.clear()
        if result is not SpanExportResult.SUCCESS:
            spans_dropped.labels("export_failed").inc(count)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flushed: bool = self._exporter.force_flush(timeout_millis)
        return flushed


def exporters_from_environment(environ: Mapping[str, str] = os.environ) -> list[Any]:
    """The span exporters OTEL_TRACES_EXPORTER names (none: tracing stays off). An unknown name or
    an OTLP protocol other than http/protobuf raises ValueError: a process configured to trace
    should not start without it."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if name.strip()]
    exporters: list[Any] = []
    for name in names:
        if name == "none":
            continue
        if name == "otlp":
            protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
            if protocol != "http/protobuf":
                raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: this gateway exports OTLP over http/protobuf only")
            from disagg_project.otlp_exporter import OtlpSpanExporter

            exporters.append(OtlpSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER names {name!r}: known are otlp, console and none")
    return exporters


def install() -> None:
    """Turn tracing on in this process if the environment asks for it (see the module's docstring);
    otherwise leave it off, at no cost."""
    if tracing.on:
        return
    exporters = exporters_from_environment()
    if not exporters:
        return
    tracing.configure(exporters)
    # A full queue is counted (gateway_trace_spans_dropped_total); the SDK's warning per burst
    # and its exporter's retry messages would otherwise flood the log while a collector is down.
    logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
    logger.info("tracing on: %s", ", ".join(type(e).__name__ for e in exporters))
