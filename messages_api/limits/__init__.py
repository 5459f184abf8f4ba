"""Per-key limits: checked when a request is accepted, settled when it ends.

    lease = await check_limits(principal.key_hash, principal.limits, Usage(prompt, max_tokens))
    ...                                  # raises `RateLimited` (429 rate_limit_error) when over
    lease.headers                        # anthropic-ratelimit-* for the answer
    lease.settle(Usage(input, output))   # in a `finally`: once, whichever way the request ended

    policy.py   the limits and their rules; local.py   kept in this process; shared.py   in Redis

With `REDIS_URL` the check is one script in Redis (one round trip) and the limits hold across
every gateway process; without it, or while Redis fails, this process's own state answers. A key
without limits costs nothing here.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from disagg_project import lease_expiry, new_id
from messages_api.errors import RateLimited
from messages_api.limits import shared
from messages_api.limits.local import LocalLimits
from messages_api.limits.policy import NO_LIMITS, BucketState, Decision, KeyLimits, Usage

__all__ = ["check_limits", "KeyLease", "KeyLimits", "local_limits", "NO_LIMITS", "refuse_early", "Usage"]

local_limits = LocalLimits()


class _EarlyRefusals:
    """What this process already knows will be refused, so that a key over its limits is answered
    before its body is parsed (a flood of 78 KB refused requests cost ~1.6 ms of parsing each).

    A key refused by a rate or a budget stays refused here until the wait it was given ends; a key
    with as many requests in flight in this process as its concurrency allows is refused until
    one ends. Both are lower bounds of what the full check would say: it still decides the rest."""

    def __init__(self) -> None:
        self.until: dict[str, tuple[float, RateLimited]] = {}
        self.in_flight: dict[str, int] = {}
        # The key's anthropic-ratelimit-* headers as of its last full check.
        self.headers: dict[str, tuple[tuple[bytes, bytes], ...]] = {}

    def refuse(self, key: str, limits: KeyLimits, now: float) -> None:
        held = self.until.get(key)
        if held is not None:
            until, error = held
            if now < until:
                wait = math.ceil(until - now)
                if (error.retry_after or 0) <= MAX_SHORT_RETRY_AFTER_S:
                    wait = min(wait, MAX_SHORT_RETRY_AFTER_S)  # a rate's wait; a budget's stays long
                raise RateLimited(error.message, retry_after=float(max(1, wait)), headers=error.headers)
            del self.until[key]
        if limits.concurrency is not None and self.in_flight.get(key, 0) >= limits.concurrency:
            raise RateLimited(_concurrency_message(limits), retry_after=1.0, headers=self.headers.get(key, ()))


early = _EarlyRefusals()


def refuse_early(key: str, limits: KeyLimits) -> None:
    """Raise the 429 this process already knows the key's next request gets (before its body is
    parsed); nothing for a key without limits."""
    if limits.any:
        early.refuse(key, limits, time.time())

# Anthropic's header names, by limit.
_HEADER_NAMES = {
    "requests": "requests",
    "input_tokens": "input-tokens",
    "output_tokens": "output-tokens",
}
_DESCRIPTIONS = {
    "requests": "requests per minute",
    "input_tokens": "input tokens per minute",
    "output_tokens": "output tokens per minute",
}
# A short wait is said as at most 59 s: Claude Code gives up at once on a retry-after over 60.
MAX_SHORT_RETRY_AFTER_S = 59


@dataclass(slots=True)
class KeyLease:
    """An admitted request's hold on its key's limits."""

    key: str
    limits: KeyLimits
    estimate: Usage
    lease: str = ""
    shared: bool = False
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    settled: bool = False

    def settle(self, actual: Usage) -> None:
        """Correct the estimate with what the request used and free its concurrency; once."""
        if self.settled or not self.limits.any:
            return
        self.settled = True
        left = early.in_flight.get(self.key, 1) - 1
        if left > 0:
            early.in_flight[self.key] = left
        else:
            early.in_flight.pop(self.key, None)
        now = time.time()
        if self.shared:
            shared.settle(self.key, self.limits, self.estimate, actual, self.lease, now)
        else:
            local_limits.settle(self.key, self.limits, self.estimate, actual, self.lease, now)


async def check_limits(key: str, limits: KeyLimits, estimate: Usage) -> KeyLease:
    """Admit the request under its key's limits, or raise a 429 `rate_limit_error`."""
    if not limits.any:
        return KeyLease(key, limits, estimate, settled=True)
    lease = new_id()
    now = time.time()
    expiry = lease_expiry()
    decision = await shared.check(key, limits, estimate, lease, expiry, now)
    is_shared = decision is not None
    if decision is None:
        # Held here until settled (a request always settles in its `finally`): no expiry.
        decision = local_limits.check(key, limits, estimate, lease, math.inf, now)
    headers = rate_limit_headers(decision.states)
    early.headers[key] = tuple(headers)
    if not decision.admitted:
        error = _refusal(decision, limits, headers, now)
        if decision.refused_by != "concurrency":
            early.until[key] = (now + decision.retry_after_s, error)
        raise error
    early.in_flight[key] = early.in_flight.get(key, 0) + 1
    return KeyLease(key, limits, estimate, lease, is_shared, headers)


def rate_limit_headers(states: dict[str, BucketState]) -> list[tuple[bytes, bytes]]:
    """Anthropic's `anthropic-ratelimit-*` headers for the limits that apply; `tokens-*` is the
    most restrictive token limit in effect (the input, output or budget one with the least left)."""
    headers: list[tuple[bytes, bytes]] = []
    for name, label in _HEADER_NAMES.items():
        state = states.get(name)
        if state is not None:
            headers += _triple(label, state)
    token_states = [s for n, s in states.items() if n != "requests"]
    if token_states:
        headers += _triple("tokens", min(token_states, key=lambda s: s.remaining))
    return headers


# Each label's three header names, encoded once.
_TRIPLE_NAMES = {
    label: tuple(f"anthropic-ratelimit-{label}-{part}".encode() for part in ("limit", "remaining", "reset"))
    for label in (*_HEADER_NAMES.values(), "tokens")
}


def _triple(label: str, state: BucketState) -> list[tuple[bytes, bytes]]:
    limit, remaining, reset = _TRIPLE_NAMES[label]
    return [
        (limit, str(state.limit).encode()),
        (remaining, str(state.remaining).encode()),
        (reset, _rfc3339_bytes(math.ceil(state.reset_at))),
    ]


@functools.lru_cache(maxsize=1024)
def _rfc3339_bytes(second: int) -> bytes:
    # Resets fall on few distinct seconds (a minute's buckets, a day's end): each is formatted
    # once instead of four strftime calls per answer (~15 µs of a limited key's request).
    return _rfc3339(second).encode()


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(math.ceil(epoch), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _refusal(decision: Decision, limits: KeyLimits, headers: list[tuple[bytes, bytes]], now: float) -> RateLimited:
    refused_by = decision.refused_by
    wait = max(1, math.ceil(decision.retry_after_s))
    if refused_by.startswith("tokens_per_"):
        kind = refused_by.removeprefix("tokens_per_")
        budget = limits.tokens_per_day if kind == "day" else limits.tokens_per_month
        message = (
            f"This API key's {'daily' if kind == 'day' else 'monthly'} budget of {budget:,} tokens is exhausted; "
            f"it renews at {_rfc3339(now + decision.retry_after_s)}."
        )
    elif refused_by == "concurrency":
        message = _concurrency_message(limits)
    else:
        limit = dict(limits.buckets)[refused_by]
        wait = min(wait, MAX_SHORT_RETRY_AFTER_S)
        message = f"This request would exceed this API key's rate limit of {limit:,} {_DESCRIPTIONS[refused_by]}."
    return RateLimited(message, retry_after=float(wait), headers=tuple(headers))


def _concurrency_message(limits: KeyLimits) -> str:
    return f"This request would exceed this API key's limit of {limits.concurrency} concurrent requests."
