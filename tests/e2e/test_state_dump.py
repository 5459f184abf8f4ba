"""`kill -USR1` makes a gateway write its threads' stacks and its asyncio tasks' await chains to
its log (messages_api/server/state_dump.py): the evidence a stuck request leaves."""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

from messages_api.server.state_dump import await_chain, dump_tasks
from tests.support.gateway import Gateway


async def innermost(event: asyncio.Event) -> None:
    await event.wait()


async def middle(event: asyncio.Event) -> None:
    await innermost(event)


async def test_a_suspended_task_shows_every_coroutine_it_awaits_through() -> None:
    event = asyncio.Event()
    task = asyncio.create_task(middle(event), name="the-waiter")
    await asyncio.sleep(0)
    chain = await_chain(task.get_coro())
    assert [line.rsplit(" in ", 1)[1] for line in chain[:3]] == ["middle", "innermost", "Event.wait"]
    out = io.StringIO()
    dump_tasks(asyncio.get_running_loop(), out)
    dumped = out.getvalue()
    assert "the-waiter" in dumped and "in innermost" in dumped and "waits on <Future pending" in dumped, dumped
    event.set()
    await task


def test_sigusr1_writes_the_gateway_s_stacks_to_its_log(gateway: Gateway, transactional_db: Any) -> None:
    assert gateway.process is not None
    gateway.dump_stacks()
    deadline = time.monotonic() + 10
    # The whole log: its last 5,000 characters (the default) can be all later lines.
    while "asyncio tasks ---" not in (log := gateway.log(limit=None)):
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.05)
    assert "--- SIGUSR1: thread stacks ---" in log and "Current thread" in log
    assert gateway.process.poll() is None  # still serving
