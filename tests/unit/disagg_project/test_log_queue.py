"""Log lines leave the event loop: the caller only enqueues; a thread formats and writes, with
the request id stamped where the request's context is."""

from __future__ import annotations

import io
import logging
import threading

from disagg_project.log_queue import move_to_thread
from messages_api.request_context import RequestIdFilter, current_request_id
from tests.support.cluster import wait_until


def test_records_are_written_by_the_listener_thread_with_the_request_id() -> None:
    logger = logging.getLogger("test-log-queue")
    logger.propagate = False
    out = io.StringIO()
    writers: list[str] = []

    class Recording(logging.StreamHandler):  # type: ignore[type-arg]
        def emit(self, record: logging.LogRecord) -> None:
            writers.append(threading.current_thread().name)
            super().emit(record)

    handler = Recording(out)
    handler.setFormatter(logging.Formatter("%(request_id)s %(message)s"))
    handler.addFilter(RequestIdFilter())
    logger.addHandler(handler)
    listener = move_to_thread(logger)
    assert listener is not None
    token = current_request_id.set("req_abc")
    try:
        values = {"n": 1}
        logger.warning("served %s", values)
        values["n"] = 2  # the caller goes on: the line keeps what was logged
    finally:
        current_request_id.reset(token)
    wait_until(lambda: out.getvalue(), timeout=5)  # the listener stops at exit
    assert out.getvalue() == "req_abc served {'n': 1}\n"
    assert writers and writers[0] != threading.current_thread().name
