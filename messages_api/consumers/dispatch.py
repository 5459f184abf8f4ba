"""How a request's work runs once its body is complete, and how the client's leaving ends it.

Channels' stock `AsyncHttpConsumer` runs `handle()` inside its receive loop, so it never sees
`http.disconnect` while a response is being produced (`http_request` awaits `handle()` before it
returns). These consumers instead run the work beside the reading of what comes next: without a
channel layer, in the application's own task while a watcher task reads (`serve_in_place`); with
one, in a task of its own beside Channels' loop (`start`). The `http.disconnect` that arrives when
the client goes away cancels the work, and the cancellation reaches everything it owns (the
pipeline, its worker requests, the heartbeat).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from channels.consumer import AsyncConsumer
from channels.exceptions import StopConsumer


class RequestTask:
    """The task a request's work runs in, and its cancellation: by the client's leaving
    (`client_left`, `disconnected`), by the key's revocation (`cancel`), by the server giving up
    on the application (`close`).

    `finished` (the consumer's answer to "is the response's last frame sent?") is passed in, not
    read from a consumer held here: the consumer holds this object, and a reference back would
    keep every finished request alive until the cyclic garbage collector found it.
    """

    __slots__ = ("task", "_in_place", "_work")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self._in_place = False  # `serve_in_place` runs the work once `start` hands it over
        self._work: Coroutine[Any, Any, None] | None = None

    def start(self, work: Coroutine[Any, Any, None]) -> None:
        """Run the request's work: in place (`serve_in_place`), or as a task of its own beside
        Channels' receive loop, which must go on reading to see the disconnect."""
        if self._in_place:
            self._work = work
        else:
            self.task = asyncio.create_task(work)

    async def serve_in_place(
        self, consumer: AsyncConsumer, scope: dict[str, Any], receive: Any, send: Any, finished: Callable[[], bool]
    ) -> None:
        """`AsyncConsumer.__call__` for a deployment without a channel layer, less its loop's cost.

        Channels reads every message through a new task and `asyncio.wait`, so even a request body
        already queued reaches `dispatch` four loop turns after the scope (`tests/unit/test_intake.py`
        counts them); under load each turn is a pass over every ready stream, and the status line
        waits for all of them. With no channel layer there is one source of messages, so reading
        it in place is the same loop: dispatch each message in order until a handler stops the
        consumer or starts the work. disagg_project/relied_on.py pins Channels' version of this
        method (checked by tests/unit/test_relied_on.py), so a change there is seen.

        Once the body is complete the request is served in this task, the application's, and a
        task of its own watches what comes next (the disconnect): the request's start is then a
        turn sooner than from a task started for it (tests/e2e/test_loop_turns.py)."""
        consumer.scope = scope  # type: ignore[assignment]  # Channels' stubs type it as a websocket scope
        consumer.channel_layer = None  # type: ignore[assignment]  # the stubs say a layer; Channels sets None too
        consumer.base_send = send
        self._in_place = True
        try:
            while self._work is None:
                await consumer.dispatch(await receive())
        except StopConsumer:
            return
        work, self._work = self._work, None
        self.task = asyncio.current_task()
        watcher = asyncio.get_running_loop().create_task(self._watch_for_disconnect(receive, finished))
        try:
            await work
        finally:
            watcher.cancel()

    async def _watch_for_disconnect(self, receive: Any, finished: Callable[[], bool]) -> None:
        """Beside a request served in place: the client's going away cancels it."""
        while (await receive())["type"] != "http.disconnect":
            pass  # the rest of a refused body
        self.client_left(finished())

    async def disconnected(self, finished: bool) -> None:
        """Channels' loop read the disconnect: the work is cancelled (`client_left`) and awaited.
        `wait`, not `await task`: the task's own CancelledError is expected, but one aimed at the
        consumer (the server giving up on it) must not be swallowed with it."""
        task = self.task
        if task is not None and not task.done():
            self.client_left(finished)
            await asyncio.wait({task})

    def client_left(self, finished: bool) -> None:
        """The client went away: its request's work is cancelled. Not once its response is
        finished: daphne also sends http.disconnect after a complete response, and the request
        is then only finishing its bookkeeping."""
        if not finished:
            self.cancel()

    def cancel(self) -> bool:
        """Cancel the work if it is running; whether it was."""
        task = self.task
        if task is None or task.done():
            return False
        task.cancel()
        return True

    async def close(self) -> None:
        """The application is ending (its client gone, the server shutting down, the
        application-close timeout): the work is cancelled and awaited. Once: a task already
        cancelled (the client left first) is in its cleanup, and a second cancellation would cut
        that short. Cancelled again while waiting, this raises at once and the task finishes its
        cleanup on its own (asyncio.wait never cancels what it waits for)."""
        task = self.task
        if task is not None and task is not asyncio.current_task() and not task.done():
            if not task.cancelling():
                task.cancel()
            await asyncio.wait({task})
