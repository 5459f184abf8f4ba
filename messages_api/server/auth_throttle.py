"""Failed authentications per client address: past a budget, 429 instead of 401, and no lookup.

Each address has GATEWAY_AUTH_FAILURES_PER_MINUTE failures at once, then one each 60/N seconds
(a generic cell rate: one float per address, the time its budget is whole again). An address over
it is *throttled*: the header gate answers its requests 429 `rate_limit_error` with `retry-after`
(the seconds until it may fail once more), except those carrying a key this process has found
valid (`KeyCache.known`), which go on as usual. So a tenant's working key is not locked out by
the failures of another client behind the same address (a NAT, an office) or of its own
misconfigured process, while a key never seen valid here (a forged one, if the tag's secret
leaked) is not looked up for a throttled address. As GitHub and Stripe do, only failures count;
a refused request (429) does not, so a client that waits `retry-after` gets its next try.

Failures are 401s at the headers: a missing, ambiguous, malformed or unknown key.

The address: the socket's peer, or behind a proxy in TRUSTED_PROXIES the client it names
(`disagg_project.address_of`, as the admin's login lockout); an IPv6 address counts by its /64
(one host holds a whole /64: counting each address would let it cycle through them).

Memory is bounded: at most `ADDRESSES_KEPT` addresses, the one whose last failure is oldest
dropped first (~150 bytes each). An attacker cycling through more addresses than that pushes out
other entries, its own included: per-address counting cannot stop a client that has that many
addresses, and it never grows. The state is this process's own (with `manage.py serve
--processes N` each process counts apart): a Redis round trip per failure would cost more than
the failure it throttles, and the header gate decides synchronously.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict

__all__ = ["address_key", "ADDRESSES_KEPT", "FailureThrottle"]

ADDRESSES_KEPT = 10_000


def address_key(address: str) -> str:
    """What an address counts as: itself, an IPv4-mapped IPv6 address as its IPv4, other IPv6 as
    its /64."""
    if ":" not in address:
        return address  # IPv4 (or a name a test server gives): as it is
    try:
        parsed = ipaddress.IPv6Address(address.split("%", 1)[0])
    except ValueError:
        return address
    if parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(ipaddress.IPv6Network((parsed, 64), strict=False))


class FailureThrottle:
    """`per_minute` failures at once per address, then one each 60/per_minute s; 0: never throttles."""

    def __init__(self, per_minute: int, addresses_kept: int = ADDRESSES_KEPT) -> None:
        self.per_minute = per_minute
        self._interval = 60.0 / per_minute if per_minute > 0 else 0.0
        # Address → when its budget is whole again (a theoretical arrival time), least recent first.
        self._whole_at: OrderedDict[str, float] = OrderedDict()
        self._kept = addresses_kept

    def retry_after(self, address: str, now: float) -> int | None:
        """Whole seconds until `address` may fail again; None when it is not throttled."""
        whole_at = self._whole_at.get(address_key(address)) if self.per_minute > 0 else None
        if whole_at is None:
            return None
        # One more failure is allowed while the budget used stays within per_minute failures.
        wait = whole_at - now - (self.per_minute - 1) * self._interval
        return max(1, math.ceil(wait)) if wait > 0 else None

    def failed(self, address: str, now: float) -> None:
        """Count a failure of `address` (one that was not throttled)."""
        if self.per_minute <= 0:
            return
        key = address_key(address)
        self._whole_at[key] = max(self._whole_at.get(key, now), now) + self._interval
        self._whole_at.move_to_end(key)
        while len(self._whole_at) > self._kept:
            self._whole_at.popitem(last=False)

    def __len__(self) -> int:
        return len(self._whole_at)
