"""The probe's deadline against a stalled event loop (a blocking callback stands in for a process
starved of CPU): the stall is the gateway's time, not the worker's."""

from __future__ import annotations

import asyncio
import time

import pytest

from workers.cluster.probe_deadline import LagTolerantDeadline

DEADLINE_S = 0.1


async def answer_during_a_stall_past_the_deadline(deadline: object) -> str:
    """The answer is due at 0.05 s; the loop stalls from 0.01 s to 0.31 s, past the 0.1 s
    deadline; answer and deadline are then both due in the loop's next turn."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str] = loop.create_future()
    loop.call_later(0.01, time.sleep, 0.3)
    loop.call_later(0.05, answer.set_result, "ok")
    async with deadline:  # type: ignore[attr-defined]
        return await answer


async def test_plain_asyncio_timeout_blames_the_worker_for_the_loops_stall() -> None:
    # Why the probe has its own deadline: the answer had arrived, the timeout still won.
    with pytest.raises(TimeoutError):
        await answer_during_a_stall_past_the_deadline(asyncio.timeout(DEADLINE_S))


async def test_an_answer_that_arrived_during_a_stall_is_read() -> None:
    deadline = LagTolerantDeadline(DEADLINE_S)
    assert await answer_during_a_stall_past_the_deadline(deadline) == "ok"
    assert deadline.lag >= 0.2 and not deadline.expired


async def test_no_answer_expires_after_the_loops_time() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = LagTolerantDeadline(DEADLINE_S)
    with pytest.raises(TimeoutError):
        async with deadline:
            await asyncio.sleep(10)
    assert deadline.expired and loop.time() - started >= DEADLINE_S


async def test_a_stall_extends_the_deadline_by_its_length() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    loop.call_later(0.01, time.sleep, 0.2)
    deadline = LagTolerantDeadline(DEADLINE_S)
    with pytest.raises(TimeoutError):
        async with deadline:
            await asyncio.sleep(10)
    assert deadline.lag >= 0.15
    # The time the block had while the loop ran: the deadline's, not less.
    assert loop.time() - started - deadline.lag >= DEADLINE_S


async def test_a_block_that_ends_in_time_leaves_no_timer() -> None:
    deadline = LagTolerantDeadline(DEADLINE_S)
    async with deadline:
        await asyncio.sleep(0)
    assert deadline._handle is None and not deadline.expired


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    async def probe() -> None:
        async with LagTolerantDeadline(10):
            await asyncio.sleep(10)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_loop_late_at_every_check_still_ends_the_block() -> None:
    loop = asyncio.get_running_loop()
    busy: list[asyncio.TimerHandle] = []

    def hog() -> None:  # 20 ms of every 30: the loop late at every check
        time.sleep(0.02)
        busy.append(loop.call_later(0.01, hog))

    busy.append(loop.call_later(0, hog))
    deadline = LagTolerantDeadline(DEADLINE_S)
    try:
        with pytest.raises(TimeoutError):
            async with deadline:
                await asyncio.sleep(10)
    finally:
        busy[-1].cancel()
    assert deadline.expired and deadline.lag > 0
