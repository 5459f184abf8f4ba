"""The Redis the tests share state through (127.0.0.1:6379 on these machines, or TEST_REDIS_URL).

Without one the tests that need it skip, or fail with REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

import pytest

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_answers(url: str = REDIS_URL) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_url_or_skip() -> str:
    if not redis_answers():
        message = f"no Redis answers at {REDIS_URL}"
        if os.environ.get("REQUIRE_REDIS"):
            pytest.fail(message)
        pytest.skip(message)
    return REDIS_URL
