"""API keys: generation, hashing, and a per-process cache so that authenticating a request does
not query the database.

Keys are random 256-bit secrets, so one unsalted SHA-256 is the right hash: there is nothing to
brute-force, and it keeps the lookup a single indexed equality (Django's password hashers are for
low-entropy passwords and cost tens of milliseconds by design).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from messages_api.models import ApiKey

KEY_PREFIX = "sk-gw-"
# How long a looked-up key (or a miss) is trusted before the database is asked again: revoking
# a key in the admin takes effect within this time in every process.
CACHE_TTL_S = 5.0
MISS_TTL_S = 1.0
# last_used_at is bookkeeping: write it at most this often per key.
LAST_USED_RESOLUTION_S = 60.0


@dataclass(frozen=True, slots=True)
class Principal:
    key_hash: str
    name: str


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
    def __init__(self) -> None:
        self._entries: dict[str, tuple[Principal | None, float]] = {}
        self._last_used_written: dict[str, float] = {}

    async def authenticate(self, key: str) -> Principal | None:
        digest = hash_key(key)
        now = time.monotonic()
        entry = self._entries.get(digest)
        if entry is None or entry[1] <= now:
            principal = await sync_to_async(_lookup, thread_sensitive=False)(digest)
            self._entries[digest] = (principal, now + (CACHE_TTL_S if principal else MISS_TTL_S))
            if len(self._entries) > 10_000:  # bound memory against key-guessing floods
                self._entries.clear()
        else:
            principal = entry[0]
        if principal is not None:
            self._touch(principal, now)
        return principal

    def _touch(self, principal: Principal, now: float) -> None:
        if now - self._last_used_written.get(principal.key_hash, -LAST_USED_RESOLUTION_S) < LAST_USED_RESOLUTION_S:
            return
        self._last_used_written[principal.key_hash] = now
        # Fire and forget on the default executor: bookkeeping must not delay the request.
        asyncio.get_running_loop().run_in_executor(None, _touch_last_used, principal.key_hash)

    def clear(self) -> None:
        self._entries.clear()


def _touch_last_used(digest: str) -> None:
    try:
        ApiKey.objects.filter(key_hash=digest).update(last_used_at=datetime.now(timezone.utc))
    finally:
        close_old_connections()


def _lookup(digest: str) -> Principal | None:
    try:
        row = ApiKey.objects.filter(key_hash=digest, active=True).values_list("name", flat=True).first()
    finally:
        close_old_connections()
    return Principal(key_hash=digest, name=row) if row is not None else None


key_cache = KeyCache()
