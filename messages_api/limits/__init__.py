"""Per-key limits: checked when a request is accepted, settled when it ends.

    lease = await check_limits(principal.key_hash, principal.limits, Usage(prompt, max_tokens))
    ...                                  # raises `AnthropicError` 429 rate_limit_error when over
    lease.headers                        # anthropic-ratelimit-* for the answer
    lease.settle(Usage(input, output))   # in a `finally`: once, whichever way the request ended

    policy.py   the limits and their rules; local.py   kept in this process; shared.py   in Redis

With `REDIS_URL` the check is one script in Redis (one round trip) and the limits hold across
every gateway process; without it, or while Redis fails, this process's own state answers. A key
without limits costs nothing here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from messages_api.errors import AnthropicError
from messages_api.limits import shared
from messages_api.limits.local import LocalLimits
from messages_api.limits.policy import NO_LIMITS, BucketState, Decision, KeyLimits, Usage
from workers import lease_expiry, new_id

__all__ = ["KeyLimits", "KeyLease", "NO_LIMITS", "Usage", "check_limits", "local_limits"]

local_limits = LocalLimits()

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
    if not decision.admitted:
        raise _refusal(decision, limits, headers, now)
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


def _triple(label: str, state: BucketState) -> list[tuple[bytes, bytes]]:
    prefix = f"anthropic-ratelimit-{label}-"
    return [
        ((prefix + "limit").encode(), str(state.limit).encode()),
        ((prefix + "remaining").encode(), str(state.remaining).encode()),
        ((prefix + "reset").encode(), _rfc3339(state.reset_at).encode()),
    ]


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(math.ceil(epoch), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _refusal(decision: Decision, limits: KeyLimits, headers: list[tuple[bytes, bytes]], now: float) -> AnthropicError:
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
        message = f"This request would exceed this API key's limit of {limits.concurrency} concurrent requests."
    else:
        limit = dict(limits.buckets)[refused_by]
        wait = min(wait, MAX_SHORT_RETRY_AFTER_S)
        message = f"This request would exceed this API key's rate limit of {limit:,} {_DESCRIPTIONS[refused_by]}."
    return AnthropicError(429, message, "rate_limit_error", retry_after=float(wait), headers=tuple(headers))
