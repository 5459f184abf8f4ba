"""Keeps a stream from going silent: a `ping` event whenever nothing was sent for an interval.

Claude Code and the proxies in front of it drop a stream that sent nothing for ~15–35 s; a
stream waiting on a long context phase sends nothing else for minutes.
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
        self._task: asyncio.Task[None] | None = None

    def sent(self) -> None:
        """Call after every frame the stream sends."""
        self.last_sent = time.monotonic()

    def due_at(self, moment: float) -> None:
        """Ping at `moment` (a `time.monotonic()` value) unless a frame goes out before."""
        self.last_sent = moment - self.interval

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    async def ping(self) -> None:
        await self._send_ping()
        self.pings_sent += 1
        self.sent()

    async def _run(self) -> None:
        while True:
            due = self.last_sent + self.interval - time.monotonic()
            if due > 0:
                await asyncio.sleep(due)
                continue
            await self.ping()
