"""What an API key may do (its limits), and what one check of them answered.

    requests / input tokens / output tokens per minute   token buckets, as Anthropic's own limits:
        capacity = the limit, refilled continuously at limit/60 per second. A request needs
        min(its cost, the capacity) in each bucket and then takes its whole cost (a bucket may go
        below zero: the next request waits for it to refill). Input is the prompt's estimate,
        output the request's `max_tokens`; both are corrected when the answer ends, as Anthropic
        does (so a bucket the estimate overdrew is paid back).
    tokens per day / per month                           budgets over UTC calendar windows:
        the tokens a key used (input + output, counted when each answer ends); a key at its
        budget is refused until the window turns.
    concurrency                                          requests in flight at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits; None: no such limit."""

    concurrency: int | None = None
    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None

    @property
    def any(self) -> bool:
        # Asked several times per request: one generated comparison, not a walk of the fields.
        return self != NO_LIMITS

    @property
    def buckets(self) -> tuple[tuple[str, int | None], ...]:
        return (
            ("requests", self.requests_per_minute),
            ("input_tokens", self.input_tokens_per_minute),
            ("output_tokens", self.output_tokens_per_minute),
        )


NO_LIMITS = KeyLimits()
BUCKETS = ("requests", "input_tokens", "output_tokens")
BUDGETS = ("day", "month")


@dataclass(frozen=True, slots=True)
class Usage:
    """What a request costs: estimated when it starts, actual when it ends."""

    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BucketState:
    """One limit after a check: its size, what is left, and when it is whole again (epoch s)."""

    limit: int
    remaining: int
    reset_at: float


@dataclass(frozen=True, slots=True)
class Decision:
    """A check's answer: admitted, or refused by `refused_by` with a wait of `retry_after_s`."""

    admitted: bool
    states: dict[str, BucketState] = field(default_factory=dict)
    refused_by: str = ""
    retry_after_s: float = 0.0


def window_start(kind: str, now: float) -> datetime:
    moment = datetime.fromtimestamp(now, timezone.utc)
    if kind == "day":
        return moment.replace(hour=0, minute=0, second=0, microsecond=0)
    return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def window_end(kind: str, now: float) -> float:
    start = window_start(kind, now)
    if kind == "day":
        return (start + timedelta(days=1)).timestamp()
    return (start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)).timestamp()


def window_id(kind: str, now: float) -> str:
    return window_start(kind, now).strftime("%Y%m%d" if kind == "day" else "%Y%m")


def bucket_level(level: float, updated: float, limit: int, now: float) -> float:
    """A bucket's level now, refilled at limit/60 per second since `updated`, never above `limit`."""
    return min(float(limit), level + max(0.0, now - updated) * limit / 60.0)


def bucket_state(level: float, limit: int, now: float) -> BucketState:
    return BucketState(limit, max(0, math.floor(level)), now + max(0.0, limit - level) * 60.0 / limit)


def costs(usage: Usage) -> dict[str, int]:
    return {"requests": 1, "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
