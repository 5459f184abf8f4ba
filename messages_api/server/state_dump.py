"""`kill -USR1 <pid>`: what a gateway process is doing, written to its stderr (the process log).

Two parts, because a stuck request is stuck in one of two ways:
- every thread's Python stack, written at once from the signal handler (`faulthandler`): if the
  event loop itself is wedged in a call, its stack says where;
- every asyncio task and what it awaits, written on the loop's next turn: a request waiting on
  something that never comes shows as a chain of coroutines ending in the future it awaits.
  asyncio's own `Task.print_stack` shows only a suspended task's outermost frame; this follows
  `cr_await` through every coroutine and async generator down to that future.

Installed under daphne by a hook of disagg_project/daphne.py. SIGUSR1 is otherwise unused here (Twisted and
daphne handle SIGINT and SIGTERM).
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from types import FrameType
from typing import Any, TextIO


def await_chain(awaitable: Any) -> list[str]:
    """Where a suspended coroutine is: one line per coroutine or async generator it awaits
    through (the innermost one awaits a future, which `dump_tasks` names)."""
    lines: list[str] = []
    current = awaitable
    for _ in range(100):  # a chain that long is a bug of its own; do not loop on it
        frame = getattr(current, "cr_frame", None) or getattr(current, "ag_frame", None)
        if frame is None:
            break
        code = frame.f_code
        lines.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_qualname}")
        following = getattr(current, "cr_await", None)
        if following is None:
            following = getattr(current, "ag_await", None)
        if following is None:
            return lines
        current = following
    return lines


def dump_tasks(loop: asyncio.AbstractEventLoop, out: TextIO | None = None) -> None:
    out = out or sys.stderr
    tasks = asyncio.all_tasks(loop)
    print(f"--- {len(tasks)} asyncio tasks ---", file=out)
    for task in tasks:
        print(f"{task.get_name()} {task.get_coro()!r}"[:300], file=out)
        for line in await_chain(task.get_coro()):
            print(f"    {line}", file=out)
        # `_fut_waiter`: the future the task is suspended on (asyncio's Task, Python and C alike;
        # an internal, listed in disagg_project/relied_on.py).
        print(f"    waits on {getattr(task, '_fut_waiter', None)!r}"[:300], file=out)
    out.flush()


def install(loop: asyncio.AbstractEventLoop) -> None:
    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        print("--- SIGUSR1: thread stacks ---", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        loop.call_soon_threadsafe(dump_tasks, loop)

    signal.signal(signal.SIGUSR1, on_signal)


__all__ = ["await_chain", "dump_tasks", "install"]
