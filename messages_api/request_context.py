"""Every log line about a request carries its request id and, when the request is traced, its
trace id (context variables set per request), and the client's text in a line is escaped
(`loggable`)."""

from __future__ import annotations

import contextvars
import logging

from disagg_project import loggable

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
# The request's OpenTelemetry trace id (32 hex digits) when it is sampled (messages_api/request_span.py).
current_trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="-")


class RequestIdFilter(logging.Filter):
    """Puts `request_id` and `trace_id` on every record that has none ("-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        if not hasattr(record, "trace_id"):
            record.trace_id = current_trace_id.get()
        return True


# Re-exported: the API's modules escape a client's text with it (the workers' code, a worker's).
__all__ = ["current_request_id", "current_trace_id", "loggable", "RequestIdFilter"]
