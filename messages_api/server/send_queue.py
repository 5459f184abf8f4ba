"""A streamed response's middle frames on a server other than daphne: queued by a function that
does not wait, handed to the ASGI `send` in order by a task.

A stream's frames are written in the worker connection's receive callback (`ChatRun.relay`), which
must not wait. Under daphne they go straight to its request (`body_writer.py`); elsewhere (an
in-process test, another ASGI server) `send` is a coroutine, so they wait here, and one task at a
time sends what has gathered, joined. So both run the same relay: only the last step differs.

Backpressure: while more than `limit` bytes wait, what fills the queue is paused (`throttle`:
the worker's stream, which then reads nothing more), and resumed once half have gone; a client
slower than its worker holds the worker back instead of filling the gateway's memory. What `send`
raises (the client is gone) is raised by the next frame queued, which ends the relay, and by
`flush`, which the last frame of the response awaits first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

# Bytes waiting before the worker's stream is paused: a few hundred frames.
LIMIT_BYTES = 64 * 1024


async def _closed(body: bytes) -> None:
    """`send` once the queue is closed: the response is over, nothing more goes out."""


def _nothing() -> None:
    pass


class SendQueue:
    """A `BodyWriter` (messages_api/server/body_writer.py) over an awaitable `send(body)`."""

    __slots__ = ("_send", "limit", "_frames", "_waiting", "_task", "_error", "_pause", "_resume", "_paused")

    def __init__(self, send: Callable[[bytes], Awaitable[None]], limit: int = LIMIT_BYTES) -> None:
        self._send = send
        self.limit = limit
        self._frames: list[bytes] = []
        self._waiting = 0  # bytes queued and not yet sent
        self._task: asyncio.Task[None] | None = None
        self._error: Exception | None = None
        self._pause: Callable[[], None] = _nothing
        self._resume: Callable[[], None] = _nothing
        self._paused = False

    def throttle(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """What to `pause` while more than `limit` bytes wait, and `resume` once half have gone."""
        self._pause, self._resume = pause, resume

    def __call__(self, frame: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._frames.append(frame)
        self._waiting += len(frame)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._send_all())
        if self._waiting > self.limit and not self._paused:
            self._paused = True
            self._pause()

    async def flush(self) -> None:
        """Wait until every frame queued is sent; raise what `send` raised."""
        task = self._task
        if task is not None:
            await asyncio.wait({task})  # a cancellation of the caller is not the sending task's
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Drop what still waits (the response is over: its request ended, or was cancelled),
        and the callables it was given: they are the consumer's and the run's bound methods, and
        holding them kept the request in a reference cycle after its end."""
        self._frames.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        self._send = _closed
        self._pause = self._resume = _nothing

    async def _send_all(self) -> None:
        try:
            while self._frames:
                body = b"".join(self._frames)
                self._frames.clear()
                await self._send(body)
                self._waiting -= len(body)
                if self._paused and self._waiting <= self.limit // 2:
                    self._paused = False
                    self._resume()
        except Exception as exc:
            self._error = exc
            self._frames.clear()
            if self._paused:  # the relay goes on, to be ended by its next frame
                self._paused = False
                self._resume()
        finally:
            self._task = None


__all__ = ["LIMIT_BYTES", "SendQueue"]
