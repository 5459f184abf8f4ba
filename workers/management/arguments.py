"""Argument types the management commands share (workers' and messages_api's)."""

from __future__ import annotations


def limit_argument(value: str) -> int:
    """A limit on the command line: a whole number, where 0 or `none` means no limit (given as 0)."""
    number = 0 if value.strip().lower() == "none" else int(value)
    if number < 0:
        raise ValueError(value)
    return number
