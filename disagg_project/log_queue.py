"""Log lines written off the event loop, under daphne.

The access log and every other record were formatted and written to stderr on the loop thread
(~37 µs a request), and a stderr pipe that fills would stop the loop. Here the root logger's
handlers move behind a `QueueHandler`: the loop only enqueues the record (after the filters that
stamp the request id, which must run where the request's context is), and a `QueueListener`
thread formats and writes it. `logging._srcfile = None` is the logging HOWTO's switch for not
looking up the caller's file and line, which no format here prints.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue

_listener: logging.handlers.QueueListener | None = None


class _StampedQueueHandler(logging.handlers.QueueHandler):
    """Enqueue the record with its message merged (its arguments may change once the caller goes
    on) but not formatted: the stock `prepare` formats the whole line here, on the loop thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg = record.getMessage()
        record.args = None
        return record


def install() -> None:
    """Move the root logger's handlers to a thread of their own (once per process)."""
    global _listener
    if _listener is None:
        logging._srcfile = None  # type: ignore[attr-defined]  # documented: skip findCaller
        _listener = move_to_thread(logging.getLogger())


def move_to_thread(root: logging.Logger) -> logging.handlers.QueueListener | None:
    """Put `root`'s handlers behind a queue and a listener thread (started; stopped at exit)."""
    handlers = list(root.handlers)
    if not handlers:
        return None
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    front = _StampedQueueHandler(records)
    for handler in handlers:
        # The filters (the request id) run on the loop, where the request's context variable is.
        for log_filter in handler.filters:
            front.addFilter(log_filter)
        root.removeHandler(handler)
    root.addHandler(front)
    listener = logging.handlers.QueueListener(records, *handlers, respect_handler_level=True)
    listener.start()
    atexit.register(listener.stop)
    return listener
