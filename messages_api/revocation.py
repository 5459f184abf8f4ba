"""Revoking an API key ends its requests in progress, not only its next ones.

The key cache (`messages_api.auth`) stops accepting a revoked key within CACHE_TTL_S, but a stream
already running would go on to its deadline (an hour). So each process keeps its open requests by
key hash, and while it has any, asks the database every CACHE_TTL_S which of those keys are still
active (one query for all of them). A key deactivated or deleted since has its requests revoked:
each one's task is cancelled, and the consumer turns that cancellation into an `error` event
(`authentication_error`, `KeyRevoked`) through its one error boundary, which ends the audit row
with the reason. Nothing is checked per token: the relay's path is untouched.

A key found revoked is also refused to new requests in this process for the next CACHE_TTL_S,
which the key cache may still hold it valid for (`add` refuses them as the cache will: 401).

A lookup that fails (the database is down) revokes nothing: it is logged and tried again.

The check runs as one task, started by the first request to open and ended at its first wake-up
that finds none open. It is not cancelled when the last request ends: a client sending one request
at a time would otherwise have a task made, a timer armed and a cancellation raised for every
request (~1-2 % of a small request's instructions, `bench/request_cpu.py --instructions`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from messages_api.auth import CACHE_TTL_S
from messages_api.errors import AuthenticationFailed
from messages_api.models import ApiKey

logger = logging.getLogger(__name__)

# Key hashes per query (well under SQLite's and PostgreSQL's parameter limits).
HASHES_PER_QUERY = 500


class KeyRevoked(AuthenticationFailed):
    """The request's API key was deactivated or deleted while the request was in progress."""

    def __init__(self) -> None:
        super().__init__("The API key was revoked while the request was in progress")


class Revocable(Protocol):
    def revoke(self) -> None:
        """End the request with `KeyRevoked` (idempotent; nothing once it has ended)."""


class OpenRequests:
    """This process's requests in progress by key hash, and the check that revokes them."""

    def __init__(self, interval: float = CACHE_TTL_S) -> None:
        self.interval = interval
        self._by_key: dict[str, set[Revocable]] = {}
        self._key_of: dict[Revocable, str] = {}
        self._checker: asyncio.Task[None] | None = None
        self._recently_revoked: dict[str, float] = {}  # key hash → refused until (monotonic)
        self.revoked = 0

    def add(self, key_hash: str, request: Revocable) -> None:
        """Track `request` until `discard`; a 401 if its key was just found revoked."""
        if self._recently_revoked:
            until = self._recently_revoked.get(key_hash)
            if until is not None:
                if until > time.monotonic():
                    raise AuthenticationFailed("invalid x-api-key")  # as the key cache will say
                del self._recently_revoked[key_hash]
        self._by_key.setdefault(key_hash, set()).add(request)
        self._key_of[request] = key_hash
        checker = self._checker
        if checker is None or checker.done() or checker.get_loop() is not asyncio.get_running_loop():
            self._checker = asyncio.get_running_loop().create_task(self._run(), name="api-key-revocation")

    def discard(self, request: Revocable) -> None:
        key_hash = self._key_of.pop(request, None)
        if key_hash is None:
            return
        requests = self._by_key.get(key_hash)
        if requests is not None:
            requests.discard(request)
            if not requests:
                del self._by_key[key_hash]
        # With nothing open the checker ends at its next wake-up (the module's docstring says why
        # it is not cancelled here).

    def open_keys(self) -> int:
        return len(self._by_key)

    def revoke_key(self, key_hash: str) -> int:
        """Revoke every open request of `key_hash`; how many there were."""
        requests = self._by_key.pop(key_hash, set())
        now = time.monotonic()
        self._recently_revoked = {k: until for k, until in self._recently_revoked.items() if until > now}
        self._recently_revoked[key_hash] = now + self.interval
        for request in requests:
            self._key_of.pop(request, None)
            request.revoke()
        self.revoked += len(requests)
        return len(requests)

    async def check(self) -> int:
        """Revoke the open requests of keys no longer active; how many were revoked."""
        hashes = list(self._by_key)
        if not hashes:
            return 0
        active = await sync_to_async(_active, thread_sensitive=False)(hashes)
        revoked = 0
        for key_hash in hashes:
            if key_hash not in active:
                count = self.revoke_key(key_hash)
                if count:
                    logger.warning("API key %s… revoked: ending its %d request(s) in progress", key_hash[:12], count)
                revoked += count
        return revoked

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if asyncio.current_task() is not self._checker:
                return
            if not self._by_key:
                self._checker = None
                return
            try:
                await self.check()
            except Exception:
                logger.exception("could not check whether open requests' API keys are still active")


def _active(hashes: list[str]) -> set[str]:
    try:
        active: set[str] = set()
        for start in range(0, len(hashes), HASHES_PER_QUERY):
            chunk = hashes[start : start + HASHES_PER_QUERY]
            active.update(ApiKey.objects.filter(key_hash__in=chunk, active=True).values_list("key_hash", flat=True))
        return active
    finally:
        close_old_connections()


open_requests = OpenRequests()
