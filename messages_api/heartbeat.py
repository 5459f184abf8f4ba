"""Keeps a stream from going silent: a `ping` event whenever nothing was sent for an interval.

Claude Code and the proxies in front of it drop a stream that sent nothing for ~15–35 s; a
stream waiting on a long context phase sends nothing else for minutes.

A heartbeat is an event-loop timer, not a task: thousands of idle streams each hold one timer
handle instead of a task and its coroutine frame, and arming it costs a heap push. A task exists
only while a ping is being sent.

`stop()` lets go of `send_ping`. That callback is usually a bound method of the heartbeat's
owner, which holds the heartbeat: a reference cycle (owner -> heartbeat -> method -> owner). Left
in place, it kept every finished request's objects (the consumer, its audit record, the
pipeline, the worker response, ~90 objects in all) alive until the cyclic garbage collector
found them, instead of freeing them the moment the request ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class Heartbeat:
    def __init__(self, interval: float, send_ping: Callable[[], Awaitable[None]]) -> None:
        self.interval = interval
        self._send_ping = send_ping
        self.last_sent = time.monotonic()
        self.pings_sent = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Task[None] | None = None
        self._running = False

    def sent(self) -> None:
        """Call after every frame the stream sends."""
        self.last_sent = time.monotonic()

    def due_at(self, moment: float) -> None:
        """Ping at `moment` (a `time.monotonic()` value) unless a frame goes out before."""
        self.last_sent = moment - self.interval
        if self._running:
            self._arm()

    def start(self) -> None:
        if self._send_ping is _no_ping:
            raise RuntimeError("a stopped heartbeat does not start again")
        if not self._running:
            self._running = True
            self._arm()

    async def stop(self) -> None:
        """Final: no ping after this, and `start()` raises."""
        self._running = False
        self._send_ping = _no_ping  # breaks the owner's cycle (see the module docstring)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        sending, self._sending = self._sending, None
        if sending is not None and not sending.done():
            sending.cancel()
            await asyncio.wait({sending})

    async def ping(self) -> None:
        await self._send_ping()
        self.pings_sent += 1
        self.sent()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # time.monotonic() is the clock of asyncio's default loops; call_later converts anyway.
        delay = self.last_sent + self.interval - time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._due)

    def _due(self) -> None:
        self._timer = None
        if not self._running:
            return
        if time.monotonic() < self.last_sent + self.interval:
            self._arm()  # a frame went out since the timer was set
            return
        self._sending = asyncio.ensure_future(self._ping_then_rearm())

    async def _ping_then_rearm(self) -> None:
        await self.ping()
        if self._running:
            self._arm()


async def _no_ping() -> None:
    """A stopped heartbeat's `send_ping`: nothing is sent after `stop()`."""
