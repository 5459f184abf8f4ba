"""workers.schedule.completion.Completion: one outcome, many waiters, never cancelled by them."""

from __future__ import annotations

import asyncio

import pytest

from workers.schedule.completion import Completion


async def test_waiters_get_the_result_on_the_next_turn_after_the_work_sets_it() -> None:
    done: Completion[int] = Completion()
    gate = asyncio.Event()

    async def work() -> int:
        await gate.wait()
        return 7

    task = done.start(work())
    woke: list[str] = []

    async def waiter() -> None:
        assert await done.wait_result() == 7
        woke.append("waiter")

    waiting = [asyncio.create_task(waiter()) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    # Turn 1: the work runs and sets the outcome as its last step; turn 2: the waiters run.
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert woke == ["waiter"] * 3
    await asyncio.gather(task, *waiting)


async def test_an_exception_is_raised_to_every_waiter_and_by_the_task() -> None:
    done: Completion[int] = Completion()

    async def work() -> int:
        await asyncio.sleep(0)
        raise ValueError("boom")

    task = done.start(work())
    for _ in range(2):
        with pytest.raises(ValueError, match="boom"):
            await done.wait_result()
    with pytest.raises(ValueError):
        await task


async def test_cancelling_a_waiter_does_not_cancel_the_work() -> None:
    done: Completion[str] = Completion()
    gate = asyncio.Event()

    async def work() -> str:
        await gate.wait()
        return "ok"

    task = done.start(work())
    waiter = asyncio.create_task(done.wait_result())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not task.cancelled() and not task.done()
    gate.set()
    assert await task == "ok"
    assert await done.wait_result() == "ok"


async def test_a_timed_wait_says_whether_the_outcome_came() -> None:
    done: Completion[None] = Completion()
    assert await done.wait(0.01) is False
    assert done._waiters == []  # a timed-out waiter is not kept
    done.set_result(None)
    assert await done.wait(0.01) is True
    assert await done.wait(0) is True


async def test_a_task_cancelled_before_its_first_step_still_ends_the_wait() -> None:
    done: Completion[int] = Completion()

    async def work() -> int:
        return 1

    task = done.start(work())
    task.cancel()  # before the task ever ran: `work` never starts, only the task's end can tell
    with pytest.raises(asyncio.CancelledError):
        await done.wait_result()
    with pytest.raises(asyncio.CancelledError):  # raised again, a fresh instance each time
        done.result()


async def test_a_cancelled_work_is_seen_as_cancelled() -> None:
    done: Completion[int] = Completion()

    async def work() -> int:
        await asyncio.Event().wait()
        return 1

    task = done.start(work())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await done.wait_result()
    assert task.cancelled()


def test_the_first_outcome_wins_and_result_needs_one() -> None:
    done: Completion[int] = Completion()
    with pytest.raises(asyncio.InvalidStateError):
        done.result()
    done.set_result(1)
    done.set_exception(ValueError())
    done.set_result(2)
    assert done.done() and done.result() == 1


async def test_the_tasks_end_does_not_override_the_works_own_outcome() -> None:
    done: Completion[int] = Completion()

    async def work() -> int:
        return 5

    task = done.start(work())
    assert await task == 5
    await asyncio.sleep(0)  # the done callback has run
    assert done.result() == 5
