"""The per-key limits kept in this process: the embedded default, and the fallback while Redis
fails. The same rules as the shared script (`messages_api.limits.shared`); tests run both on the
same sequences and compare."""

from __future__ import annotations

from dataclasses import dataclass, field

from messages_api.limits.policy import (
    BUCKETS,
    BucketState,
    Decision,
    KeyLimits,
    Usage,
    bucket_level,
    bucket_state,
    costs,
    window_end,
    window_id,
)


@dataclass(slots=True)
class _KeyState:
    # bucket → (level, updated)
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)
    # (kind, window id) → tokens used
    used: dict[tuple[str, str], int] = field(default_factory=dict)
    # lease → expiry
    leases: dict[str, float] = field(default_factory=dict)


class LocalLimits:
    def __init__(self) -> None:
        self._keys: dict[str, _KeyState] = {}

    def check(self, key: str, limits: KeyLimits, estimate: Usage, lease: str, lease_expiry: float, now: float) -> Decision:
        state = self._keys.setdefault(key, _KeyState())
        states: dict[str, BucketState] = {}
        refused_by, wait = "", 0.0
        wanted = costs(estimate)
        levels: dict[str, float] = {}
        for name, limit in limits.buckets:
            if limit is None:
                continue
            level, updated = state.buckets.get(name, (float(limit), now))
            level = levels[name] = bucket_level(level, updated, limit, now)
            need = min(wanted[name], limit)
            if level < need:
                bucket_wait = (need - level) * 60.0 / limit
                if bucket_wait > wait:
                    refused_by, wait = name, bucket_wait
        for kind, budget in (("day", limits.tokens_per_day), ("month", limits.tokens_per_month)):
            if budget is None:
                continue
            used = state.used.get((kind, window_id(kind, now)), 0)
            states[f"tokens_per_{kind}"] = BucketState(budget, max(0, budget - used), window_end(kind, now))
            if used >= budget:
                budget_wait = window_end(kind, now) - now
                if budget_wait > wait or not refused_by:
                    refused_by, wait = f"tokens_per_{kind}", max(wait, budget_wait)
        if limits.concurrency is not None:
            live = {lease_id: expiry for lease_id, expiry in state.leases.items() if expiry > now}
            state.leases = live
            if len(live) >= limits.concurrency and not refused_by:
                refused_by, wait = "concurrency", 1.0
        admitted = not refused_by
        for name, limit in limits.buckets:
            if limit is None:
                continue
            level = levels[name] - (wanted[name] if admitted else 0)
            state.buckets[name] = (level, now)
            states[name] = bucket_state(level, limit, now)
        if admitted and limits.concurrency is not None:
            state.leases[lease] = lease_expiry
        return Decision(admitted, states, refused_by, wait)

    def settle(self, key: str, limits: KeyLimits, estimate: Usage, actual: Usage, lease: str, now: float) -> None:
        state = self._keys.get(key)
        if state is None:
            return
        state.leases.pop(lease, None)
        correction = {"input_tokens": actual.input_tokens - estimate.input_tokens, "output_tokens": actual.output_tokens - estimate.output_tokens}
        for name, limit in limits.buckets:
            if limit is None or name not in correction or name not in state.buckets:
                continue
            level, updated = state.buckets[name]
            state.buckets[name] = (min(float(limit), bucket_level(level, updated, limit, now) - correction[name]), now)
        spent = actual.input_tokens + actual.output_tokens
        for kind, budget in (("day", limits.tokens_per_day), ("month", limits.tokens_per_month)):
            if budget is not None and spent:
                window = (kind, window_id(kind, now))
                # Old windows go: one entry per kind is all a check reads.
                state.used = {w: n for w, n in state.used.items() if w[0] != kind or w == window}
                state.used[window] = state.used.get(window, 0) + spent

    def forget(self) -> None:
        self._keys.clear()


__all__ = ["BUCKETS", "LocalLimits"]
