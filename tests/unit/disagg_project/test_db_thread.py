"""workers.cluster.db_thread: background ORM work on a thread of its own, which keeps its SQLite
connection between calls (opening one per call was ~30 % of an idle gateway's CPU), hands a
pooled one back after every call, and drops either after a call that failed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection

from disagg_project.db_thread import DatabaseThread
from workers.models import WorkerPool


def _connection_in_use() -> int:
    WorkerPool.objects.count()
    return id(connection.connection)


def _connection_closed() -> bool:
    return connection.connection is None


def _query_then_fail() -> None:
    WorkerPool.objects.count()
    raise RuntimeError("the work failed")


@pytest.mark.django_db(transaction=True)
async def test_calls_run_one_at_a_time_on_one_thread_of_their_own(transactional_db: Any) -> None:
    thread = DatabaseThread("test-db")
    idents = {await thread.run(threading.get_ident) for _ in range(5)}
    assert len(idents) == 1
    assert threading.get_ident() not in idents


@pytest.mark.django_db(transaction=True)
async def test_sqlite_keeps_its_connection_a_pooled_one_goes_back(transactional_db: Any) -> None:
    thread = DatabaseThread("test-db")
    first = await thread.run(_connection_in_use)
    closed_between = await thread.run(_connection_closed)
    second = await thread.run(_connection_in_use)
    if connection.vendor == "sqlite":
        assert not closed_between
        assert first == second  # the same connection, not a new one per call
    else:
        assert closed_between  # handed back to the pool after every call


@pytest.mark.django_db(transaction=True)
async def test_a_failed_call_raises_and_drops_the_connection(transactional_db: Any) -> None:
    thread = DatabaseThread("test-db")
    await thread.run(_connection_in_use)
    with pytest.raises(RuntimeError, match="the work failed"):
        await thread.run(_query_then_fail)
    assert await thread.run(_connection_closed)
    assert await thread.run(WorkerPool.objects.count) == 0  # and the next call reconnects
