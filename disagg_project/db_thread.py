"""A thread of its own for one kind of background ORM work, keeping its SQLite connection.

    _RELOADS = DatabaseThread("registry-db")
    snapshot = await _RELOADS.run(load_snapshot)

The gateway's background work (the registry's reload every second, the health probes' writes, the
heartbeat and the recovery sweep) used to run on asgiref's shared executor, opening a database
connection for every call and closing it after. Idle, that was most of a gateway's CPU: on SQLite,
opening and closing the connection (the `PRAGMA`s of `init_command`, Django's ~30 SQL functions
registered on it) was ~30 % of the ~6.5 ms per second an idle process spent.

Each `DatabaseThread` is one thread, so its Django connection (thread-local) outlives the call:
- SQLite: kept open between calls, as the row writer keeps its own (`disagg_project.writer`). It is
  closed after a call that raised, so the next one starts on a fresh connection.
- Any other backend (PostgreSQL, whose connections come from psycopg's pool): handed back after
  every call as before (`close_old_connections`), so a background thread never holds a pooled
  connection while it sleeps.

One thread per kind of work, not one for all: a reload of the registry must never queue behind a
health write that waits on SQLite's write lock.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from django.db import close_old_connections, connection

P = ParamSpec("P")
T = TypeVar("T")


class DatabaseThread:
    """Runs synchronous ORM functions, one at a time, on a thread of its own."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`function(*args, **kwargs)` on this thread; its result, or what it raised."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(_call, function, *args, **kwargs))


def _call(function: Callable[..., T], /, *args: object, **kwargs: object) -> T:
    try:
        result = function(*args, **kwargs)
    except BaseException:
        connection.close()  # it may be what failed: the next call opens a new one
        raise
    if connection.vendor != "sqlite":
        close_old_connections()  # pooled: back to the pool
    return result


__all__ = ["DatabaseThread"]
