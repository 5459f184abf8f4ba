"""Every log line about a request carries its request id (a context variable set per request), and
the client's text in a line is escaped (`loggable`)."""

from __future__ import annotations

import contextvars
import logging

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators: each would let
# a client's text end a log line (and forge the next) or drive the reader's terminal (ANSI escapes).
# Backslashes are doubled, so an escape in the log is never the client's own.
_LOG_ESCAPES = {
    **{code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))},
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
    ord("\\"): "\\\\",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def loggable(text: str) -> str:
    """`text` (the client's: a model name, an error message quoting a request) safe in one log line."""
    return text.translate(_LOG_ESCAPES)
