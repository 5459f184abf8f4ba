"""API keys: generation, hashing, and a per-process cache so that authenticating a request does
not query the database.

Keys are random 256-bit secrets, so one unsalted SHA-256 is the right hash: there is nothing to
brute-force, and it keeps the lookup a single indexed equality (Django's password hashers are for
low-entropy passwords and cost tens of milliseconds by design).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from fnmatch import fnmatchcase

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from messages_api.limits.policy import NO_LIMITS, KeyLimits
from messages_api.models import ApiKey

logger = logging.getLogger(__name__)

KEY_PREFIX = "sk-gw-"
# How long a looked-up key (or a miss) is trusted before the database is asked again: revoking
# a key in the admin takes effect within this time in every process.
CACHE_TTL_S = 5.0
MISS_TTL_S = 1.0
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

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or any(fnmatchcase(model, pattern) for pattern in self.allowed_models)


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(name: str) -> tuple[ApiKey, str]:
    """Create a key; the plain key is returned once and never stored."""
    key = generate_key()
    api_key = ApiKey.objects.create(name=name, key_hash=hash_key(key), prefix=key[: len(KEY_PREFIX) + 6])
    return api_key, key


def key_from_headers(headers: dict[bytes, bytes]) -> str | None:
    """`x-api-key`, else `Authorization: Bearer` (the SDKs send one or the other, or both)."""
    key = headers.get(b"x-api-key")
    if key:
        return key.decode("latin-1").strip()
    authorization = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


class KeyCache:
    """Looked-up keys (and misses) for a few seconds, one lookup at a time per key.

    A burst of requests with a key whose entry has expired shares one database lookup instead of
    each sending its own (a thousand concurrent lookups once took half of the process's CPU and
    held every request's start behind them), and a key in use is looked up again shortly before
    its entry expires, in the background, so its requests do not wait for the database at all.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Principal | None, float]] = {}
        self._lookups: dict[str, asyncio.Future[Principal | None]] = {}
        self._last_used_written: dict[str, float] = {}

    async def authenticate(self, key: str) -> Principal | None:
        digest = hash_key(key)
        now = time.monotonic()
        entry = self._entries.get(digest)
        if entry is not None and entry[1] > now:
            principal = entry[0]
            if principal is not None and entry[1] - now < REFRESH_AHEAD_S:
                self._shared_lookup(digest)  # fire and forget: the entry stays valid meanwhile
        else:
            # Shielded: one waiter's cancellation (its client left) must not fail the others.
            principal = await asyncio.shield(self._shared_lookup(digest))
        if principal is not None:
            self._touch(principal, now)
        return principal

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
        if len(self._entries) > 10_000:  # bound memory against key-guessing floods
            self._entries.clear()
        self._entries[digest] = (principal, time.monotonic() + (CACHE_TTL_S if principal else MISS_TTL_S))
        return principal

    def _touch(self, principal: Principal, now: float) -> None:
        if now - self._last_used_written.get(principal.key_hash, -LAST_USED_RESOLUTION_S) < LAST_USED_RESOLUTION_S:
            return
        self._last_used_written[principal.key_hash] = now
        # Fire and forget on the default executor: bookkeeping must not delay the request.
        asyncio.get_running_loop().run_in_executor(None, _touch_last_used, principal.key_hash)

    def clear(self) -> None:
        self._entries.clear()


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
    "output_tokens_per_minute", "tokens_per_day", "tokens_per_month",
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
    )


key_cache = KeyCache()
