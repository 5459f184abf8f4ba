"""Waiting for a condition on something a test can only read again: a worker's stats, an engine's
metrics. Plain Python, so the support modules that run as processes of their own can use it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(read: Callable[[], T], predicate: Callable[[T], bool], *, timeout: float, interval: float = 0.02, what: str = "the value") -> T:
    """`read()` again every `interval` seconds until `predicate` holds of what it returns; that
    value, or AssertionError with the last one after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if predicate(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} never met the condition within {timeout} s; last: {value}")
        time.sleep(interval)
