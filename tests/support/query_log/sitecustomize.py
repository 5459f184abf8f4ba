"""Loaded by a gateway that a test starts with this directory on its PYTHONPATH
(tests/e2e/test_key_flood.py): every SQL statement any of its database connections executes is
appended to $GATEWAY_QUERY_LOG as one line, `<sql> | <params>`, before it runs. With
$GATEWAY_QUERY_DELAY_S set, each statement on the API key table first sleeps that long (a database
under load). A gateway started any other way never loads it."""

import os
import time
from typing import Any

from django.db.backends.signals import connection_created

_PATH = os.environ["GATEWAY_QUERY_LOG"]
_DELAY_S = float(os.environ.get("GATEWAY_QUERY_DELAY_S") or 0)


def _logged(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
    line = " ".join(str(sql).split()) + " | " + " ".join(repr(params).split()) + "\n"
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode("utf-8", "replace"))  # O_APPEND: lines from threads do not interleave
    finally:
        os.close(fd)
    if _DELAY_S and "messages_api_apikey" in line:
        time.sleep(_DELAY_S)
    return execute(sql, params, many, context)


def _install(sender: Any, connection: Any, **kwargs: Any) -> None:
    if _logged not in connection.execute_wrappers:
        connection.execute_wrappers.append(_logged)


connection_created.connect(_install, weak=False)
