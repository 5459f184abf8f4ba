"""A health probe's deadline that the gateway's own event loop lag does not use up.

`asyncio.timeout(2)` measures wall time. When the loop runs late (the process starved of CPU, a
long callback, a stop), the worker's answer can be in the socket by the deadline and still lose:
the loop handles the socket's readiness and the due timer in the same turn, the timer cancels
the probe, and the task that would have read the answer only runs in the next turn (after a
SIGSTOP the loop even runs its due timers in a turn with no events). The worker is then blamed
for time the gateway did not give it.

`LagTolerantDeadline(seconds)` checks the time every `tick` while its block runs. A check that
runs late adds its lateness to the deadline (the loop was not running: that time is the
gateway's, not the worker's) and, unless the check before it was excused too, does not expire:
the next check comes a tick later, after the loop has read what arrived meanwhile. A loop late at
every check still ends the block, after `seconds` of the time it kept (every other check may
expire). While the loop keeps time the block ends after `seconds`, as under `asyncio.timeout`.
One timer per block, as `asyncio.timeout`; it never fires for a block that ends before its first
tick (a probe answered in time).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["LagTolerantDeadline"]

#: Lateness under this is the loop's ordinary jitter, not a stall.
_ON_TIME_S = 0.005


class LagTolerantDeadline:
    """`async with LagTolerantDeadline(seconds):` raises TimeoutError when the block has not ended
    after `seconds` of time the loop kept; `lag` is how much it added for the loop's lateness."""

    def __init__(self, seconds: float, tick: float | None = None) -> None:
        self.seconds = seconds
        self.tick = tick if tick is not None else max(min(0.1, seconds / 4), 0.001)
        self.lag = 0.0
        self.expired = False
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._started = 0.0
        self._cancelling = 0
        # The last check ran late and was let off expiring.
        self._excused = False

    async def __aenter__(self) -> LagTolerantDeadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("LagTolerantDeadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        self._arm(loop, self._started)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        assert self._task is not None
        if self.expired and exc_type is asyncio.CancelledError and self._task.uncancel() <= self._cancelling:
            raise TimeoutError(f"no answer within {self.seconds:g} s of the loop's time") from exc

    def _deadline(self) -> float:
        return self._started + self.seconds + self.lag

    def _arm(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        due = min(now + self.tick, max(self._deadline(), now))
        self._handle = loop.call_at(due, self._check, loop, due)

    def _check(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        late = now - due
        if late > _ON_TIME_S:
            # The loop did not run for `late` seconds: not the worker's time.
            self.lag += late
            if not self._excused:
                # This check does not expire; the next comes a tick later, after the loop has
                # read its sockets.
                self._excused = True
                self._handle = loop.call_at(now + self.tick, self._check, loop, now + self.tick)
                return
        self._excused = False
        if now >= self._deadline():
            self.expired = True
            self._handle = None
            assert self._task is not None
            self._task.cancel()
            return
        self._arm(loop, now)
