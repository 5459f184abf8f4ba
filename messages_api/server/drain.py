"""Graceful shutdown under daphne: on SIGTERM, stop accepting connections, let the requests in
flight finish for up to `GATEWAY_DRAIN_TIMEOUT_S`, then stop as before (daphne cancels what is
left: the client-disconnect path, so every reservation is still released and every audit row
closed).

Without it, Twisted's own SIGTERM handler stops the reactor at once and every open stream, a
Claude Code turn included, ends with an error. Under `manage.py serve`, several processes share
one listening socket: a draining process closes only its own copy, so its siblings keep
accepting while it finishes its streams.

A second SIGTERM, or SIGINT, stops at once. `GATEWAY_DRAIN_TIMEOUT_S=0` keeps Twisted's
behaviour. While draining, `/ready` answers 503 (`is_draining()`), so a load balancer that still
holds connections to this process stops choosing it.

This reads daphne's server through the listening port's factory (`Port.factory.server
.connections`): internals listed in disagg_project/relied_on.py (tests/unit/disagg_project/test_relied_on.py checks
that they exist).
daphne is imported only when the drain is installed: importing `daphne.server` installs Twisted's
reactor, which no other process (a management command, the views' import) should do.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

from django.conf import settings

logger = logging.getLogger(__name__)


POLL_INTERVAL_S = 0.05

_draining = False


def is_draining() -> bool:
    """Whether this process got SIGTERM and is finishing its requests before it stops."""
    return _draining


def install(reactor: Any) -> None:
    """Take SIGTERM over from Twisted once the reactor runs (it installs its handlers while
    starting; `callWhenRunning` comes after that)."""
    timeout = float(settings.GATEWAY_DRAIN_TIMEOUT_S)
    if timeout > 0:
        reactor.callWhenRunning(_take_over_sigterm, reactor, timeout)


def _take_over_sigterm(reactor: Any, timeout: float) -> None:
    drain = _Drain(reactor, timeout)

    def on_sigterm(number: int, frame: FrameType | None) -> None:
        # A signal handler runs between bytecodes: hand the work to the reactor's thread.
        reactor.callFromThread(drain.signalled)

    signal.signal(signal.SIGTERM, on_sigterm)


class _Drain:
    def __init__(self, reactor: Any, timeout: float) -> None:
        self.reactor = reactor
        self.timeout = timeout
        self.deadline: float | None = None
        self.servers: list[Any] = []

    def signalled(self) -> None:
        global _draining
        _draining = True
        if self.deadline is not None:
            logger.warning("second SIGTERM while draining: stopping now")
            self.reactor.stop()
            return
        self.deadline = time.monotonic() + self.timeout
        ports = list(listening_ports(self.reactor))
        self.servers = [s for s in {id(p.factory.server): p.factory.server for p in ports}.values()]
        for port in ports:
            port.stopListening()
        logger.warning(
            "SIGTERM: no longer accepting connections; draining %d request(s) for up to %.0f s",
            self.in_flight(), self.timeout,
        )
        self.check()

    def in_flight(self) -> int:
        return sum(_running(server.connections.values()) for server in self.servers)

    def check(self) -> None:
        assert self.deadline is not None
        left = self.in_flight()
        if left == 0 or time.monotonic() >= self.deadline:
            if left:
                logger.warning("drain timed out with %d request(s) in flight: cancelling them", left)
            self.reactor.stop()
            return
        self.reactor.callLater(POLL_INTERVAL_S, self.check)


def listening_ports(reactor: Any) -> Iterable[Any]:
    """daphne's listening TCP ports (the readers whose factory is daphne's HTTPFactory)."""
    from daphne.http_protocol import HTTPFactory

    for reader in reactor.getReaders():
        factory = getattr(reader, "factory", None)
        if isinstance(factory, HTTPFactory) and hasattr(reader, "stopListening"):
            yield reader


def _running(connections: Iterable[dict[str, Any]]) -> int:
    """Connections whose application has not returned (idle keep-alive ones do not count).

    A connection whose client has disconnected counts until its application returns: a client
    that read its whole answer and hung up leaves a request still writing its audit row and
    releasing its reservations, which stopping now would cancel (a CI run saw the row `cancelled`
    after the stream had finished whole). A client that left mid-answer is being cancelled
    anyway, and its application returns as soon as that cleanup is done."""
    count = 0
    for details in connections:
        instance = details.get("application_instance")
        if instance is not None and not instance.done():
            count += 1
    return count
