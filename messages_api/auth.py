"""API keys: generation, hashing, reading a request's credentials, and a per-process cache so that
authenticating a request does not query the database.

Keys are random 256-bit secrets, so one unsalted SHA-256 is the right hash: there is nothing to
brute-force, and it keeps the lookup a single indexed equality (Django's password hashers are for
low-entropy passwords and cost tens of milliseconds by design).

Under daphne the key is checked while the request's headers are parsed, before its body is read
(messages_api/server/header_gate.py); the consumer checks it again (a dictionary lookup then).
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fnmatch import fnmatchcase

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from messages_api.limits.policy import NO_LIMITS, KeyLimits
from messages_api.models import ApiKey

logger = logging.getLogger(__name__)

KEY_PREFIX = "sk-gw-"
# How long a looked-up key (or a miss) is trusted before the database is asked again: revoking
# a key in the admin takes effect within this time in every process.
CACHE_TTL_S = 5.0
MISS_TTL_S = 1.0
# Keys found not to exist, kept apart from the valid ones: at most this many, least recently seen
# dropped first, so a flood of random keys can evict only other misses, never a valid key.
MISSES_KEPT = 10_000
# No key of ours is longer, and none has a character outside printable ASCII: such a credential is
# refused without a database lookup.
MAX_KEY_LENGTH = 256

MISSING_KEY = "x-api-key header is required"
INVALID_KEY = "invalid x-api-key"
# A key in use is looked up again in the background once its entry has less than this left.
REFRESH_AHEAD_S = 1.0
# last_used_at is bookkeeping: write it at most this often per key.
LAST_USED_RESOLUTION_S = 60.0


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated key: who it is, and what it may do."""

    key_hash: str
    name: str
    key_id: int = 0
    limits: KeyLimits = NO_LIMITS
    priority: str = "standard"
    #: Model names or fnmatch patterns the key may use; empty: any.
    allowed_models: tuple[str, ...] = ()
    #: The key's prefix-cache namespace (`cache_salt`): the workers' caches keep it apart from
    #: other keys' where the pool says so. Kept out of repr (and so out of logs).
    cache_salt: str = field(default="", repr=False)

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or any(fnmatchcase(model, pattern) for pattern in self.allowed_models)


def cache_salt(key_id: int, cache_group: str = "") -> str:
    """The prefix-cache salt of a key: the same for every key of a cache group, else the key's
    own. An HMAC of the key's id (or group name) under SECRET_KEY, never of its secret, so a
    worker's logs tell nothing of the key; 256 bits in unpadded base64url (43 characters), as vLLM
    asks of a salt. Stable across processes and restarts; rotating SECRET_KEY starts every
    cache afresh."""
    scope = f"group:{cache_group}" if cache_group else f"key:{key_id}"
    digest = hmac.new(settings.SECRET_KEY.encode(), b"prefix-cache-salt:" + scope.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(name: str, *, cache_group: str = "") -> tuple[ApiKey, str]:
    """Create a key; the plain key is returned once and never stored."""
    key = generate_key()
    api_key = ApiKey.objects.create(name=name, key_hash=hash_key(key), prefix=key[: len(KEY_PREFIX) + 6], cache_group=cache_group)
    return api_key, key


class CredentialError(ValueError):
    """Credentials that cannot be used as they are (answered 401 with this message)."""


def key_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The API key of a request's header list (an ASGI scope's `headers`): see `key_from_values`."""
    api_keys: list[bytes] = []
    authorizations: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"x-api-key":
            api_keys.append(value)
        elif lowered == b"authorization":
            authorizations.append(value)
    return key_from_values(api_keys, authorizations)


def key_from_values(api_keys: Sequence[bytes], authorizations: Sequence[bytes]) -> str | None:
    """The key of a request with these `x-api-key` and `Authorization` header values: the SDKs send
    one or the other, or both with the same key. None when there is none; `CredentialError` when
    they are ambiguous (two of a header, or two different keys: which one would be charged?) or
    cannot be a key (not printable ASCII, or too long)."""
    if len(api_keys) > 1:
        raise CredentialError("The request has more than one x-api-key header: send one")
    if len(authorizations) > 1:
        raise CredentialError("The request has more than one Authorization header: send one")
    key = api_keys[0].strip(b" \t") if api_keys else b""
    bearer = b""
    if authorizations:
        scheme, _, value = authorizations[0].strip(b" \t").partition(b" ")
        if scheme.lower() == b"bearer":
            bearer = value.strip(b" \t")
    if key and bearer and key != bearer:
        raise CredentialError("x-api-key and Authorization: Bearer carry different keys: send one")
    chosen = key or bearer
    if not chosen:
        return None
    if len(chosen) > MAX_KEY_LENGTH or not chosen.isascii() or not chosen.decode("ascii").isprintable():
        raise CredentialError(INVALID_KEY)
    return chosen.decode("ascii")


class NotCached(enum.Enum):
    """What `KeyCache.peek` says of a key only the database can tell about."""

    NOT_CACHED = "not cached"


NOT_CACHED = NotCached.NOT_CACHED


class KeyCache:
    """Looked-up keys (and misses) for a few seconds, one lookup at a time per key.

    A burst of requests with a key whose entry has expired shares one database lookup instead of
    each sending its own (a thousand concurrent lookups once took half of the process's CPU and
    held every request's start behind them), and a key in use is looked up again shortly before
    its entry expires, in the background, so its requests do not wait for the database at all.

    Valid keys and misses are kept apart: the valid ones are as many as the database holds; the
    misses (anyone can send a new random key with every request) are an LRU of at most
    `misses_kept`, which only other misses can push out.
    """

    def __init__(self, misses_kept: int = MISSES_KEPT) -> None:
        self._known: dict[str, tuple[Principal, float]] = {}  # digest → (principal, expiry)
        self._misses: OrderedDict[str, float] = OrderedDict()  # digest → expiry, least recent first
        self._misses_kept = misses_kept
        self._lookups: dict[str, asyncio.Future[Principal | None]] = {}
        self._last_used_written: dict[str, float] = {}

    def peek(self, key: str) -> Principal | None | NotCached:
        """What the cache knows of `key` now, without waiting: its principal, None for a key known
        not to be valid, NOT_CACHED when only the database can tell (`lookup`)."""
        return self._peek(hash_key(key), time.monotonic())

    def lookup(self, key: str) -> asyncio.Future[Principal | None]:
        """The database lookup of `key` (shared with any already in flight); its answer is cached."""
        return self._shared_lookup(hash_key(key))

    async def authenticate(self, key: str) -> Principal | None:
        return await self.authenticate_hash(hash_key(key))

    async def authenticate_hash(self, digest: str) -> Principal | None:
        """`authenticate` for a key known by its hash (a Message Batch's owner, whose items run
        without the key's request)."""
        now = time.monotonic()
        cached = self._peek(digest, now)
        if cached is NOT_CACHED:
            # Shielded: one waiter's cancellation (its client left) must not fail the others.
            principal = await asyncio.shield(self._shared_lookup(digest))
        else:
            principal = cached
            if principal is not None and self._known[digest][1] - now < REFRESH_AHEAD_S:
                self._shared_lookup(digest)  # fire and forget: the entry stays valid meanwhile
        if principal is not None:
            self._touch(principal, now)
        return principal

    def _peek(self, digest: str, now: float) -> Principal | None | NotCached:
        known = self._known.get(digest)
        if known is not None and known[1] > now:
            return known[0]
        missed = self._misses.get(digest)
        if missed is not None and missed > now:
            self._misses.move_to_end(digest)
            return None
        return NOT_CACHED

    def _shared_lookup(self, digest: str) -> asyncio.Future[Principal | None]:
        """The lookup of `digest` in flight, started if there is none."""
        lookup = self._lookups.get(digest)
        if lookup is None or lookup.get_loop() is not asyncio.get_running_loop():
            lookup = self._lookups[digest] = asyncio.ensure_future(self._fetch(digest))
            lookup.add_done_callback(_log_failure)
        return lookup

    async def _fetch(self, digest: str) -> Principal | None:
        try:
            principal = await sync_to_async(_lookup, thread_sensitive=False)(digest)
        finally:
            self._lookups.pop(digest, None)
        self._store(digest, principal)
        return principal

    def _store(self, digest: str, principal: Principal | None) -> None:
        now = time.monotonic()
        if principal is not None:
            self._misses.pop(digest, None)
            self._known[digest] = (principal, now + CACHE_TTL_S)
            return
        self._known.pop(digest, None)  # revoked or deleted since it was cached
        self._misses[digest] = now + MISS_TTL_S
        self._misses.move_to_end(digest)
        while len(self._misses) > self._misses_kept:
            self._misses.popitem(last=False)

    def _touch(self, principal: Principal, now: float) -> None:
        if now - self._last_used_written.get(principal.key_hash, -LAST_USED_RESOLUTION_S) < LAST_USED_RESOLUTION_S:
            return
        self._last_used_written[principal.key_hash] = now
        # Fire and forget on the default executor: bookkeeping must not delay the request.
        asyncio.get_running_loop().run_in_executor(None, _touch_last_used, principal.key_hash)

    def clear(self) -> None:
        self._known.clear()
        self._misses.clear()


def _log_failure(lookup: asyncio.Future[Principal | None]) -> None:
    # A background refresh has no waiter to raise into; its waiters (if any) see the error too.
    if not lookup.cancelled() and lookup.exception() is not None:
        logger.error("API key lookup failed", exc_info=lookup.exception())


def _touch_last_used(digest: str) -> None:
    try:
        ApiKey.objects.filter(key_hash=digest).update(last_used_at=datetime.now(timezone.utc))
    finally:
        close_old_connections()


_PRINCIPAL_FIELDS = (
    "id", "name", "priority", "allowed_models", "max_concurrency", "requests_per_minute", "input_tokens_per_minute",
    "output_tokens_per_minute", "tokens_per_day", "tokens_per_month", "cache_group",
)


def _lookup(digest: str) -> Principal | None:
    try:
        row = ApiKey.objects.filter(key_hash=digest, active=True).values(*_PRINCIPAL_FIELDS).first()
    finally:
        close_old_connections()
    if row is None:
        return None
    return Principal(
        key_hash=digest,
        name=row["name"],
        key_id=row["id"],
        limits=KeyLimits(
            concurrency=row["max_concurrency"],
            requests_per_minute=row["requests_per_minute"],
            input_tokens_per_minute=row["input_tokens_per_minute"],
            output_tokens_per_minute=row["output_tokens_per_minute"],
            tokens_per_day=row["tokens_per_day"],
            tokens_per_month=row["tokens_per_month"],
        ),
        priority=row["priority"],
        allowed_models=tuple(m for m in row["allowed_models"] or () if isinstance(m, str)),
        cache_salt=cache_salt(row["id"], row["cache_group"]),
    )


key_cache = KeyCache()
