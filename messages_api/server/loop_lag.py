"""How late the event loop runs, and shedding new work while it runs too late.

A callback scheduled every `interval` seconds measures how much later than asked it ran: the
loop's lag, the time every other request's next step waits. While it passes
`GATEWAY_SHED_LOOP_LAG_S` new API requests are answered 529 `overloaded_error` at once (Dynamo
sheds the same way), so that the requests already running recover instead of everyone slowing
down together. The lag counts as over until a measurement below the threshold.

"New" counts from the request's arrival, not from when the loop got round to it: a request the
server had received before the loop measured itself over (`over_since`) is kept. Under a burst
the requests that arrive together are the lag, which the loop measures only once it has read them
all; shedding some of them for the lag they make together would refuse requests the gateway had
already taken in, at random, while the next arrivals are the ones to refuse (bench/burst.py).
"""

from __future__ import annotations

import asyncio
import time

from django.conf import settings
from prometheus_client import Counter, Gauge

loop_lag = Gauge("gateway_event_loop_lag_seconds", "How late the event loop ran its last lag probe.")
shed = Counter("gateway_shed_requests", "API requests answered 529 because the event loop lagged.")

_INTERVAL_S = 0.05


class LagMonitor:
    def __init__(self) -> None:
        self.lag = 0.0
        # When a measurement last found the lag over the threshold after one under it (monotonic
        # seconds; None while under): requests received before it are not shed.
        self.over_since: float | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._handle is None:
            self._schedule(loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        due = loop.time() + _INTERVAL_S
        self._handle = loop.call_at(due, self._measure, loop, due)

    def _measure(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        self.lag = max(0.0, loop.time() - due)
        loop_lag.set(self.lag)
        threshold = settings.GATEWAY_SHED_LOOP_LAG_S
        if not (threshold and self.lag > threshold):
            self.over_since = None
        elif self.over_since is None:
            self.over_since = time.monotonic()
        self._schedule(loop)

    def overloaded(self, received: float | None = None) -> bool:
        """Whether a request received at `received` (monotonic seconds; None: now) should be shed
        now: the lag is over the threshold and was measured so before the request arrived.
        Always False with shedding off (threshold 0)."""
        threshold = settings.GATEWAY_SHED_LOOP_LAG_S
        if not (threshold and self.lag > threshold):
            return False
        since = self.over_since
        return since is None or received is None or received >= since


monitor = LagMonitor()


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Start measuring on the server's loop (once per process)."""
    monitor.start(loop)
