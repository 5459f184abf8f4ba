"""A piece of work's outcome, announced by the work itself, for any number of waiters.

Why not await the task: a task's end reaches its waiters through its done callbacks, which the
loop runs one turn later, and `asyncio.shield` or `asyncio.wait` around it (both needed so that a
cancelled waiter does not cancel the work) add a second turn of their own. Under load each turn is
a full pass over every ready stream, so a stream start that crosses three such waits pays six
passes where three would do. The work sets its `Completion` as its own last step; every waiter
wakes on the next turn, and cancelling a waiter never touches the work.

    opened: Completion[ChunkStream] = Completion()
    task = opened.start(open_stream())   # the task, for whoever cancels the work
    stream = await opened.wait_result()  # elsewhere, by any number of waiters
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_UNSET = object()


class Completion(Generic[T]):
    """Set once, with a result or an exception; later sets are ignored (the first outcome wins)."""

    __slots__ = ("_outcome", "_exception", "_waiters")

    def __init__(self) -> None:
        self._outcome: object = _UNSET
        self._exception: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []

    def done(self) -> bool:
        return self._outcome is not _UNSET

    def set_result(self, result: T) -> None:
        if self._outcome is _UNSET:
            self._outcome = result
            self._wake()

    def set_exception(self, exception: BaseException) -> None:
        if self._outcome is _UNSET:
            self._outcome = None
            self._exception = exception
            self._wake()

    def start(self, work: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Run `work` as a task that sets this from its outcome as its last step. The task's end
        sets it too, for a task cancelled before its first step (`work` never ran)."""
        task = asyncio.get_running_loop().create_task(self._run(work), name=name)
        task.add_done_callback(functools.partial(self._task_ended, work))
        return task

    async def _run(self, work: Coroutine[Any, Any, T]) -> T:
        try:
            result = await work
        except BaseException as exc:
            # A cancellation is kept bare (`result()` raises a fresh one anyway): the caught one's
            # traceback holds this frame and the work's, a reference cycle through this completion.
            self.set_exception(asyncio.CancelledError() if isinstance(exc, asyncio.CancelledError) else exc)
            raise
        self.set_result(result)
        return result

    def _task_ended(self, work: Coroutine[Any, Any, T], task: asyncio.Task[T]) -> None:
        # A coroutine that never started is closed here, or Python warns it was never awaited;
        # closing one that ran to its end does nothing.
        work.close()
        if self._outcome is not _UNSET:
            return
        if task.cancelled():
            self.set_exception(asyncio.CancelledError())
        elif (exception := task.exception()) is not None:
            self.set_exception(exception)
        else:
            self.set_result(task.result())

    def result(self) -> T:
        """The result, or the work's exception raised; `InvalidStateError` before either."""
        if self._outcome is _UNSET:
            raise asyncio.InvalidStateError("the work has not ended")
        if self._exception is not None:
            if isinstance(self._exception, asyncio.CancelledError):
                raise asyncio.CancelledError()  # a fresh one: a shared instance grows its traceback
            raise self._exception
        return self._outcome  # type: ignore[return-value]  # set by set_result, hence a T

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the outcome; True once there is one. Cancelling the
        waiter cancels only the wait."""
        if self._outcome is not _UNSET:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            if timeout is None:
                await waiter
            else:
                async with asyncio.timeout(timeout):
                    await waiter
        except TimeoutError:
            return False
        finally:
            if self._outcome is _UNSET:
                self._waiters.remove(waiter)
        return True

    async def wait_result(self) -> T:
        """Wait for the outcome and return the result, or raise the work's exception."""
        await self.wait()
        return self.result()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
