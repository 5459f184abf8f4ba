"""Every log line about a request carries its request id (a context variable set per request), and
the client's text in a line is escaped (`loggable`)."""

from __future__ import annotations

import contextvars
import logging

from disagg_project import loggable

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


# Re-exported: the API's modules escape a client's text with it (the workers' code, a worker's).
__all__ = ["current_request_id", "loggable", "RequestIdFilter"]
