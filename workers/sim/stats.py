"""What the worker saw: request outcome counters and the last request bodies."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from typing import Any


class Outcome(enum.Enum):
    """How a /v1/chat/completions request ended; each request ends in exactly one."""

    COMPLETED = "completed"  # the whole answer was sent
    ABORTED = "aborted"  # the client closed the connection before the answer ended
    FAILED = "failed"  # answered with an error status, or dropped by a fault


class Stats:
    """Counters for /sim/stats. `active` is a gauge, so `reset()` leaves it alone."""

    __slots__ = ("received", "completed", "aborted", "failed", "active")

    def __init__(self) -> None:
        self.active = 0
        self.reset()

    def reset(self) -> None:
        self.received = 0
        self.completed = 0
        self.aborted = 0
        self.failed = 0

    def start(self) -> None:
        self.received += 1
        self.active += 1

    def finish(self, outcome: Outcome) -> None:
        self.active -= 1
        if outcome is Outcome.COMPLETED:
            self.completed += 1
        elif outcome is Outcome.ABORTED:
            self.aborted += 1
        else:
            self.failed += 1

    def snapshot(self) -> dict[str, int]:
        return {
            "received": self.received,
            "completed": self.completed,
            "aborted": self.aborted,
            "failed": self.failed,
            "active": self.active,
        }


class RequestLog:
    """The last `size` chat requests, oldest first, so tests can see what was sent: each body and
    the few headers in `RECORDED_HEADERS` (an allow-list: a request's other headers may carry
    credentials, which a test double must not keep either)."""

    RECORDED_HEADERS = ("x-request-id", "traceparent", "tracestate")

    def __init__(self, size: int = 200) -> None:
        self._entries: deque[tuple[Any, dict[str, str]]] = deque(maxlen=size)

    def append(self, body: Any, headers: Mapping[str, str] | None = None) -> None:
        """`headers` lower-cased, as the app reads them."""
        headers = headers or {}
        self._entries.append((body, {name: headers[name] for name in self.RECORDED_HEADERS if name in headers}))

    def bodies(self) -> list[Any]:
        return [body for body, _ in self._entries]

    def entries(self) -> list[dict[str, Any]]:
        """`{"body": ..., "headers": {...}}` per request."""
        return [{"body": body, "headers": headers} for body, headers in self._entries]

    def clear(self) -> None:
        self._entries.clear()
