"""The API key cache: one database lookup per key however many requests arrive at once, a key in
use refreshed before its entry expires, and revocation taking effect within the cache's lifetime."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from messages_api import auth
from messages_api.auth import KeyCache, create_api_key, hash_key
from messages_api.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The digests the cache asked the database for (the real lookup still runs)."""
    seen: list[str] = []
    real = auth._lookup

    def counting(digest: str) -> Any:
        seen.append(digest)
        time.sleep(0.02)  # a database under load: long enough for the burst to pile up
        return real(digest)

    monkeypatch.setattr(auth, "_lookup", counting)
    return seen


async def test_a_burst_with_an_uncached_key_shares_one_lookup(lookups: list[str]) -> None:
    _, key = await sync_to_async(create_api_key)("burst")
    cache = KeyCache()
    principals = await asyncio.gather(*(cache.authenticate(key) for _ in range(200)))
    assert {p.name for p in principals if p is not None} == {"burst"} and None not in principals
    assert lookups == [hash_key(key)]


async def test_an_unknown_key_is_refused_and_its_miss_cached(lookups: list[str]) -> None:
    cache = KeyCache()
    assert await cache.authenticate("sk-gw-not-a-key") is None
    assert await cache.authenticate("sk-gw-not-a-key") is None
    assert len(lookups) == 1


async def test_one_waiter_leaving_does_not_fail_the_others(lookups: list[str]) -> None:
    _, key = await sync_to_async(create_api_key)("leaver")
    cache = KeyCache()
    leaving = asyncio.create_task(cache.authenticate(key))
    staying = asyncio.create_task(cache.authenticate(key))
    await asyncio.sleep(0)  # both are waiting on the one lookup
    leaving.cancel()
    principal = await staying
    assert principal is not None and principal.name == "leaver"
    assert leaving.cancelled()


async def test_a_key_in_use_is_refreshed_ahead_and_a_revocation_lands(lookups: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "CACHE_TTL_S", 0.5)
    monkeypatch.setattr(auth, "REFRESH_AHEAD_S", 0.4)
    _, key = await sync_to_async(create_api_key)("revoked-later")
    digest = hash_key(key)
    cache = KeyCache()
    assert await cache.authenticate(key) is not None
    await sync_to_async(ApiKey.objects.filter(key_hash=digest).update)(active=False)
    # Inside the refresh window the cached answer is served at once and a lookup starts behind it.
    while cache._entries[digest][1] - time.monotonic() > auth.REFRESH_AHEAD_S:
        await asyncio.sleep(0.01)
    assert await cache.authenticate(key) is not None
    refresh = cache._lookups[digest]
    assert await cache.authenticate(key) is not None and cache._lookups[digest] is refresh  # one refresh
    assert await refresh is None
    assert await cache.authenticate(key) is None  # revoked, before the old entry would have expired
    assert len(lookups) == 2
