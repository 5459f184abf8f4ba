"""Log lines written off the event loop, under daphne.

The access log and every other record were formatted and written to stderr on the loop thread
(~37 µs a request), and a stderr pipe that fills would stop the loop. Here the root logger's
handlers move behind a `QueueHandler`: the loop only enqueues the record (after the filters that
stamp the request id, which must run where the request's context is), and a thread of its own
(`BatchingListener`) formats and writes it. `logging._srcfile = None` is the logging HOWTO's switch
for not looking up the caller's file and line, which no format here prints.

The thread takes records a batch at a time: it blocks only while the queue is empty, then lets
`BATCH_WINDOW_S` of records gather before it writes them. A record that wakes a waiting thread
costs the caller a futex call and the process two to four context switches; with the stock
`QueueListener` every record did (bench/request_cpu.py --request small: ~80 µs of the listener's
CPU and ~4 context switches per request). In a batch, only the first record of a window does.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import threading
import time
from collections.abc import Sequence

__all__ = ["BATCH_WINDOW_S", "BatchingListener", "install", "move_to_thread"]

#: How long the listener lets records gather after the first one wakes it. A line reaches stderr
#: at most this much later than it was logged.
BATCH_WINDOW_S = 0.05

_STOP = object()
_listener: BatchingListener | None = None


class _StampedQueueHandler(logging.handlers.QueueHandler):
    """Enqueue the record with its message merged (its arguments may change once the caller goes
    on) but not formatted: the stock `prepare` formats the whole line here, on the loop thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg = record.getMessage()
        record.args = None
        return record


class BatchingListener:
    """Hands the records queued on `records` to `handlers` (each at its own level) on a thread of
    its own, a batch per wake-up. `stop()` writes what was queued before it and ends the thread."""

    def __init__(self, records: queue.SimpleQueue[object], handlers: Sequence[logging.Handler], window: float = BATCH_WINDOW_S) -> None:
        self.records = records
        self.handlers = tuple(handlers)
        self.window = window
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.records.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        records = self.records
        while True:
            batch = [records.get()]  # the only blocking wait: the queue is empty
            time.sleep(self.window)
            while True:
                try:
                    batch.append(records.get_nowait())
                except queue.Empty:
                    break
            for record in batch:
                if record is _STOP:
                    return
                assert isinstance(record, logging.LogRecord)
                for handler in self.handlers:
                    if record.levelno >= handler.level:
                        handler.handle(record)


def install() -> None:
    """Move the root logger's handlers to a thread of their own (once per process)."""
    global _listener
    if _listener is None:
        logging._srcfile = None  # documented: skip findCaller
        _listener = move_to_thread(logging.getLogger())


def move_to_thread(root: logging.Logger) -> BatchingListener | None:
    """Put `root`'s handlers behind a queue and a listener thread (started; stopped at exit)."""
    handlers = list(root.handlers)
    if not handlers:
        return None
    records: queue.SimpleQueue[object] = queue.SimpleQueue()
    front = _StampedQueueHandler(records)
    for handler in handlers:
        # The filters (the request id) run on the loop, where the request's context variable is.
        for log_filter in handler.filters:
            front.addFilter(log_filter)
        root.removeHandler(handler)
    root.addHandler(front)
    listener = BatchingListener(records, handlers)
    listener.start()
    atexit.register(listener.stop)
    return listener
