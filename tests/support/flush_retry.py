"""The test database's flush, tried again when PostgreSQL picks it as a deadlock's victim.

Between tests, pytest-django empties the database with one `TRUNCATE` of every table, while the
gateway processes that other fixtures keep running go on writing: the row writer's transaction
holds an audit row's table and reads `messages_api_apikey` for the usage it writes with it
(messages_api/usage.py). TRUNCATE takes its locks table by table in an order of its own, so the
two can wait on each other; PostgreSQL then aborts one. When it aborts the flush, the flush is
run again (the gateway's writer retries its own batch).
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError
from django.db.backends.base.operations import BaseDatabaseOperations

ATTEMPTS = 5

_flush = BaseDatabaseOperations.execute_sql_flush


def _execute_sql_flush_retrying(self: BaseDatabaseOperations, sql_list: list[str]) -> Any:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _flush(self, sql_list)
        except OperationalError as exc:
            if "deadlock detected" not in str(exc) or attempt == ATTEMPTS:
                raise
            time.sleep(0.1 * attempt)
    return None


def install() -> None:
    BaseDatabaseOperations.execute_sql_flush = _execute_sql_flush_retrying  # type: ignore[method-assign]
