"""A real OTLP/HTTP trace receiver for tests: `POST /v1/traces` bodies decoded with the official
`opentelemetry-proto` package (`ExportTraceServiceRequest`), on a thread of its own.

    with OtlpReceiver() as receiver:
        ...  # a gateway with OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url
        spans = receiver.wait_for(lambda spans: any(s.name == "generation" for s in spans))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedSpan"]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    """One span as the receiver decoded it."""

    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    event_attributes: dict[str, dict[str, Any]] = field(default_factory=dict)  # by event name (the last of a name)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id) of each linked span
    start_ns: int = 0  # Unix nanoseconds
    end_ns: int = 0


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.bodies: list[bytes] = []  # each POST's body, as it came
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request, body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, request: ExportTraceServiceRequest, body: bytes) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            status_code=span.status.code,
                            status_message=span.status.message,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[e.name for e in span.events],
                            resource=resource,
                            event_attributes={e.name: {a.key: _value(a.value) for a in e.attributes} for e in span.events},
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
            self.bodies.append(body)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 15.0) -> list[ReceivedSpan]:
        """The spans received so far, once `predicate` holds for them."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"no such spans within {timeout} s; received: {[(s.name, s.trace_id) for s in spans]}")
            time.sleep(0.05)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
