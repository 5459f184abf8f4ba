"""What a request's headers alone decide, before its body is read: the HTTP intake guard asks
`check()` once a request's headers are in (messages_api/server/http_guard.py).

- The body limit (`body_limit`): the route's own on the API routes (MESSAGES_MAX_BODY_BYTES, a
  batch's BATCH_MAX_BYTES: `routes.body_limit`); on any other path
  (Django's pages, an unknown path: none takes a large body) Django's DATA_UPLOAD_MAX_MEMORY_SIZE
  if lower, so that a request without a key cannot have a large body read on another path.
- The API key, on every route that requires one (`routes.requires_api_key`): a missing, unknown,
  malformed or ambiguous credential is refused with 401 before a byte of the body is read. A key
  the cache knows (valid or not) is decided at once, and so is one the gateway did not issue
  (`auth.KeyCache`: no lookup); any other waits for its database lookup (shared with every
  request carrying the same key, and cached) while the connection is not read. A lookup that
  waited too long for its turn is answered 529 overloaded_error (`refusals.key_lookup_refusal`);
  one that fails otherwise lets the request through: the consumer looks again and answers as it does for
  any failure.
- Failed authentications per client address (`auth_throttle`): past GATEWAY_AUTH_FAILURES_PER_MINUTE,
  the address's requests are answered 429 rate_limit_error with `retry-after` instead of 401,
  and any key this process has not found valid is not looked up for it; a known valid key goes
  on. A request with a valid key the cache holds touches none of this.
- `/metrics`: to loopback clients (the socket's own peer, and no proxy's forwarding header), or
  to whoever presents `Authorization: Bearer <METRICS_TOKEN>` when one is set (401 without it,
  403 off loopback without one set). The view applies the same rule to the address its server
  reports (`metrics_refusal`), for servers other than daphne.
- The Cookie header: Python 3.11's cookie parser, which Django runs on every request it serves, is
  quadratic in a quoted value full of backslashes (CVE-2024-7592: 4 KiB cost ~37 ms of CPU, 8 KiB
  ~130 ms, the 16 KiB a header line may hold ~510 ms). Cookie headers over GATEWAY_MAX_COOKIE_BYTES
  in all are refused with 431, and one with a backslash with 400 (no cookie has one: RFC 6265's
  cookie-octet excludes it; without one the parser is linear), before Django sees them.

The path a route is matched on is the one daphne gives the application (percent-decoded, the
query string cut), so `/v1/%6dessages` is checked as `/v1/messages`; the guard removes the
`Daphne-Root-Path` header, which would let a client move the path daphne routes on.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol
from urllib.parse import unquote

from django.conf import settings
from prometheus_client import Counter

from disagg_project import address_of
from messages_api.auth import (
    INVALID_KEY,
    MISSING_KEY,
    NOT_CACHED,
    CredentialError,
    Principal,
    key_cache,
    key_from_values,
)
from messages_api.routes import body_limit as route_body_limit
from messages_api.routes import requires_api_key
from messages_api.server.auth_throttle import FailureThrottle

__all__ = [
    "body_limit",
    "check",
    "FORWARDING_HEADERS",
    "is_loopback",
    "KeyLookup",
    "metrics_refusal",
    "Refusal",
    "scope_path",
]

METRICS_PATH = "/metrics"
# Headers a proxy adds: a request carrying one came through a proxy, whatever its socket peer is.
FORWARDING_HEADERS = (b"x-forwarded-for", b"forwarded", b"x-real-ip")


class RawHeaders(Protocol):
    """What the guard passes: Twisted's `Headers` (case-insensitive names, every value of a name)."""

    def getRawHeaders(self, name: bytes) -> Sequence[bytes] | None: ...


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    message: str
    error_type: str
    #: An API request without a valid key: counted and sampled into the audit as the consumers' 401s.
    unauthenticated: bool = False
    #: Whole seconds for a `retry-after` header (429, 529).
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """The key's database lookup, in flight: its principal, or None for no valid key."""

    future: asyncio.Future[Principal | None]


def check(target: bytes, headers: RawHeaders, peer_host: str | None) -> Refusal | KeyLookup | None:
    """The verdict on a request for `target` (the request line's target) with these headers from a
    socket whose peer is `peer_host`: refuse, wait for the key's lookup, or go on (None)."""
    cookies = headers.getRawHeaders(b"cookie") or ()
    cookie_bytes = sum(len(value) for value in cookies)
    if cookie_bytes > settings.GATEWAY_MAX_COOKIE_BYTES:
        return Refusal(431, f"The Cookie header is larger than the limit of {settings.GATEWAY_MAX_COOKIE_BYTES} bytes", "request_too_large")
    if any(b"\\" in value for value in cookies):
        return Refusal(400, "The Cookie header has a backslash, which no cookie may contain", "invalid_request_error")
    path = scope_path(target)
    if path is None:
        return None  # daphne answers 400 for a path it cannot decode
    if path == METRICS_PATH:
        forwarded = any(headers.getRawHeaders(name) for name in FORWARDING_HEADERS)
        return metrics_refusal(headers.getRawHeaders(b"authorization") or (), peer_host, forwarded)
    if requires_api_key(path):
        return _key_verdict(headers, peer_host)
    return None


def body_limit(target: bytes) -> int:
    """The largest body a request for `target` may have."""
    limit: int = settings.MESSAGES_MAX_BODY_BYTES
    path = scope_path(target)
    if path is not None and requires_api_key(path):
        return route_body_limit(path)
    django_limit: int | None = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return min(limit, django_limit) if django_limit is not None else limit


def scope_path(target: bytes) -> str | None:
    """The path daphne puts in the ASGI scope for this request target; None when the target is not
    ASCII, which daphne answers with 400 itself (its path or its query string)."""
    try:
        raw = target.decode("ascii")
    except UnicodeDecodeError:
        return None
    return unquote(raw.split("?", 1)[0])


auth_throttled = Counter(
    "gateway_auth_throttled",
    "API requests answered 429 because their client address failed authentication too often "
    "(GATEWAY_AUTH_FAILURES_PER_MINUTE).",
)
_throttle: FailureThrottle | None = None


def _key_verdict(headers: RawHeaders, peer_host: str | None) -> Refusal | KeyLookup | None:
    try:
        key = key_from_values(headers.getRawHeaders(b"x-api-key") or (), headers.getRawHeaders(b"authorization") or ())
    except CredentialError as exc:
        return _failure(headers, peer_host, str(exc))
    if key is None:
        return _failure(headers, peer_host, MISSING_KEY)
    known = key_cache.peek(key)
    if known is None:
        return _failure(headers, peer_host, INVALID_KEY)
    if known is NOT_CACHED:
        address = _client_address(headers, peer_host)
        if address is not None:
            throttled = _throttled(address)
            if throttled is not None and not key_cache.known(key):
                return throttled
        lookup = key_cache.lookup(key)
        if address is not None:
            lookup.add_done_callback(partial(_count_failure, address))
        return KeyLookup(lookup)
    return None  # a valid key the cache holds: no address, no throttle


def _failure(headers: RawHeaders, peer_host: str | None, message: str) -> Refusal:
    """A 401 with `message`, counted against the client's address, or its 429 if it is throttled."""
    address = _client_address(headers, peer_host)
    if address is not None:
        throttled = _throttled(address)
        if throttled is not None:
            return throttled
        _get_throttle().failed(address, time.monotonic())
    return Refusal(401, message, "authentication_error", unauthenticated=True)


def _throttled(address: str) -> Refusal | None:
    wait = _get_throttle().retry_after(address, time.monotonic())
    if wait is None:
        return None
    auth_throttled.inc()
    return Refusal(
        429, f"Too many requests without a valid API key from this address: retry after {wait} seconds", "rate_limit_error",
        unauthenticated=True, retry_after=wait,
    )


def _count_failure(address: str, lookup: asyncio.Future[Principal | None]) -> None:
    if not lookup.cancelled() and lookup.exception() is None and lookup.result() is None:
        _get_throttle().failed(address, time.monotonic())


def _get_throttle() -> FailureThrottle:
    global _throttle
    per_minute = settings.GATEWAY_AUTH_FAILURES_PER_MINUTE
    if _throttle is None or _throttle.per_minute != per_minute:
        _throttle = FailureThrottle(per_minute)
    return _throttle


def _client_address(headers: RawHeaders, peer_host: str | None) -> str | None:
    forwarded = headers.getRawHeaders(b"x-forwarded-for") or ()
    return address_of(peer_host, b",".join(forwarded).decode("latin-1"))


def metrics_refusal(authorizations: Sequence[bytes], peer_host: str | None, forwarded: bool) -> Refusal | None:
    """Who may read /metrics (they name worker endpoints): with METRICS_TOKEN set, whoever presents
    it as a bearer token; without one, a loopback peer whose request came through no proxy."""
    token = settings.METRICS_TOKEN
    if token:
        presented = _bearer(authorizations)
        if presented is None:
            return Refusal(401, "/metrics requires Authorization: Bearer <METRICS_TOKEN>", "authentication_error")
        if not hmac.compare_digest(presented, token.encode()):
            return Refusal(401, "invalid metrics token", "authentication_error")
        return None
    if is_loopback(peer_host) and not forwarded:
        return None
    return Refusal(403, "/metrics is served to loopback clients only (set METRICS_TOKEN to scrape it from elsewhere)", "permission_error")


def _bearer(authorizations: Sequence[bytes]) -> bytes | None:
    if len(authorizations) != 1:
        return None
    scheme, _, value = authorizations[0].strip(b" \t").partition(b" ")
    value = value.strip(b" \t")
    return value if scheme.lower() == b"bearer" and value else None


def is_loopback(host: str | None) -> bool:
    """`host` is an IP address of this machine's loopback (127/8, ::1, or ::ffff:127.x.y.z)."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
