"""What a request's headers alone decide, before its body is read: the HTTP intake guard asks
`check()` once a request's headers are in (messages_api/server/http_guard.py).

- The body limit (`body_limit`): the route's own on the API routes (MESSAGES_MAX_BODY_BYTES, a
  batch's BATCH_MAX_BYTES: `routes.body_limit`); on any other path
  (Django's pages, an unknown path: none takes a large body) Django's DATA_UPLOAD_MAX_MEMORY_SIZE
  if lower, so that a request without a key cannot have a large body read on another path.
- The API key, on every route that requires one (`routes.requires_api_key`): a missing, unknown or
  ambiguous credential is refused with 401 before a byte of the body is read. A key the cache
  knows (valid or not) is decided at once; any other waits for its database lookup (shared with
  every request carrying the same key, and cached: `auth.KeyCache`) while the connection is not
  read. A lookup that fails lets the request through: the consumer looks again and answers as
  it does for any failure.
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote

from django.conf import settings

from messages_api.auth import INVALID_KEY, MISSING_KEY, NOT_CACHED, CredentialError, Principal, key_cache, key_from_values
from messages_api.routes import requires_api_key
from messages_api.routes import body_limit as route_body_limit

__all__ = ["FORWARDING_HEADERS", "KeyLookup", "Refusal", "body_limit", "check", "is_loopback", "metrics_refusal", "scope_path"]

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
        return _key_verdict(headers)
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


def _key_verdict(headers: RawHeaders) -> Refusal | KeyLookup | None:
    try:
        key = key_from_values(headers.getRawHeaders(b"x-api-key") or (), headers.getRawHeaders(b"authorization") or ())
    except CredentialError as exc:
        return Refusal(401, str(exc), "authentication_error", unauthenticated=True)
    if key is None:
        return Refusal(401, MISSING_KEY, "authentication_error", unauthenticated=True)
    known = key_cache.peek(key)
    if known is NOT_CACHED:
        return KeyLookup(key_cache.lookup(key))
    if known is None:
        return Refusal(401, INVALID_KEY, "authentication_error", unauthenticated=True)
    return None


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
