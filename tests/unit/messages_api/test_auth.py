"""The API key cache: one database lookup per key however many requests arrive at once, a key in
use refreshed before its entry expires, revocation taking effect within the cache's lifetime, and
misses kept apart from valid keys (a flood of unknown keys evicts only other misses), keys the
gateway did not issue refused without a lookup (legacy keys still working), and lookups bounded.
And the reading of a request's credentials: ambiguous or malformed ones are refused."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from messages_api import auth, key_format
from messages_api.auth import NOT_CACHED, CredentialError, KeyCache, Principal, create_api_key, generate_key, hash_key, key_from_headers
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
    unknown = generate_key()  # of the issued form (as a revoked or deleted key is): worth one lookup
    cache = KeyCache()
    assert await cache.authenticate(unknown) is None
    assert await cache.authenticate(unknown) is None
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
    while cache._known[digest][1] - time.monotonic() > auth.REFRESH_AHEAD_S:
        await asyncio.sleep(0.01)
    assert await cache.authenticate(key) is not None
    refresh = cache._lookups[digest]
    assert await cache.authenticate(key) is not None and cache._lookups[digest] is refresh  # one refresh
    assert await refresh is None
    assert await cache.authenticate(key) is None  # revoked, before the old entry would have expired
    assert len(lookups) == 2


async def test_a_flood_of_unknown_keys_never_evicts_a_valid_key(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """Past 10,000 cached entries the cache used to forget everything, valid keys included: every
    request of every tenant then waited for the database again. Misses now have an LRU of their
    own, which only other misses can push out."""
    valid_key = generate_key()
    valid = Principal(key_hash=hash_key(valid_key), name="valid")
    looked_up: list[str] = []

    def lookup(digest: str) -> Principal | None:  # the database, without its cost
        looked_up.append(digest)
        return valid if digest == valid.key_hash else None

    monkeypatch.setattr(auth, "_lookup", lookup)
    # The flood must not outlast the valid key's entry on a loaded machine (it took over 5 s once).
    monkeypatch.setattr(auth, "CACHE_TTL_S", 3600.0)
    # Nor the lookups' turns: 1,000 lookups at a time through their few turns took over the 2 s
    # a lookup may wait for one on a loaded machine (the bound is tested on its own).
    settings.GATEWAY_KEY_LOOKUP_WAIT_S = 3600.0
    cache = KeyCache()
    assert await cache.authenticate(valid_key) == valid
    flood = [generate_key() for _ in range(auth.MISSES_KEPT + 2000)]  # issued-form keys: each looked up
    for start in range(0, len(flood), 1000):
        assert set(await asyncio.gather(*(cache.authenticate(k) for k in flood[start : start + 1000]))) == {None}
    looked_up.clear()
    assert cache.peek(valid_key) == valid
    assert await cache.authenticate(valid_key) == valid
    assert looked_up == []  # served from the cache
    assert len(cache._misses) == auth.MISSES_KEPT


async def test_misses_are_kept_least_recently_seen_first_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "_lookup", lambda digest: None)
    cache = KeyCache(misses_kept=3)
    a, b, c, d = (generate_key() for _ in range(4))
    for key in (a, b, c):
        assert await cache.authenticate(key) is None
    assert cache.peek(a) is None  # seen again: now the most recent
    assert await cache.authenticate(d) is None  # pushes out the least recent: b
    assert [cache.peek(k) for k in (a, b, c, d)] == [None, NOT_CACHED, None, None]


async def test_a_revoked_key_moves_from_the_valid_to_the_misses(lookups: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "CACHE_TTL_S", 0.05)
    _, key = await sync_to_async(create_api_key)("revoked")
    cache = KeyCache()
    assert await cache.authenticate(key) is not None
    await sync_to_async(ApiKey.objects.filter(key_hash=hash_key(key)).update)(active=False)
    await asyncio.sleep(0.06)
    assert cache.peek(key) is NOT_CACHED
    assert await cache.lookup(key) is None
    assert cache.peek(key) is None and hash_key(key) not in cache._known


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([], None),
        ([(b"x-api-key", b" k1 ")], "k1"),
        ([(b"Authorization", b"Bearer k1")], "k1"),
        ([(b"authorization", b"bearer  k1 ")], "k1"),
        ([(b"x-api-key", b"k1"), (b"authorization", b"Bearer k1")], "k1"),
        ([(b"x-api-key", b""), (b"authorization", b"Bearer k1")], "k1"),
        ([(b"x-api-key", b"k1"), (b"authorization", b"Basic dXNlcjpwdw==")], "k1"),
        ([(b"authorization", b"Basic dXNlcjpwdw==")], None),
        ([(b"X-Api-Key", b"k1"), (b"x-api-key", b"k2")], "more than one x-api-key"),
        ([(b"x-api-key", b"k1"), (b"x-api-key", b"k1")], "more than one x-api-key"),
        ([(b"authorization", b"Bearer k1"), (b"authorization", b"Bearer k1")], "more than one Authorization"),
        ([(b"x-api-key", b"k1"), (b"authorization", b"Bearer k2")], "different keys"),
        ([(b"authorization", b"Bearer \xc3\xa9")], "invalid x-api-key"),
        ([(b"x-api-key", b"k\x1b[2J")], "invalid x-api-key"),
        ([(b"x-api-key", b"k" * 257)], "invalid x-api-key"),
    ],
)
def test_credentials_from_headers(headers: list[tuple[bytes, bytes]], expected: str | None) -> None:
    """The consumers read the scope's header list (a dict of it kept only the last x-api-key)."""
    if expected is None or expected.startswith("k"):
        assert key_from_headers(headers) == expected
        return
    with pytest.raises(CredentialError, match=expected):
        key_from_headers(headers)


# --- keys the gateway did not issue: refused without a lookup -----------------------------------------


@pytest.fixture
def legacy_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each load of the legacy keys' hashes (the real query still runs)."""
    loads: list[int] = []
    real = auth._legacy_hashes

    def counting() -> frozenset[str]:
        loads.append(1)
        return real()

    monkeypatch.setattr(auth, "_legacy_hashes", counting)
    return loads


def not_issued() -> list[str]:
    issued = generate_key()
    return [
        "sk-gw-" + secrets.token_urlsafe(32),  # the old form, in no database
        issued[:-1] + ("A" if issued[-1] != "A" else "B"),  # the issued form with a wrong tag
        issued + "x",
        issued[:-1],
        "hello",
        "Bearer",
        "sk-ant-api03-" + secrets.token_urlsafe(40),
        key_format.new_key(key_format.derive_secret("another deployment's secret")),
    ]


async def test_keys_the_gateway_did_not_issue_are_refused_without_a_lookup(lookups: list[str], legacy_loads: list[int]) -> None:
    cache = KeyCache()
    for _ in range(3):
        for key in not_issued():
            assert await cache.authenticate(key) is None, key
            assert cache.peek(key) is None
            assert await cache.lookup(key) is None
    assert lookups == []
    assert legacy_loads == [1]  # the legacy keys' hashes, once: a finite set that no longer grows
    assert not cache._misses  # and they hold no memory


async def test_a_legacy_key_still_works_and_its_neighbours_are_not_looked_up(lookups: list[str], legacy_loads: list[int]) -> None:
    legacy = "sk-gw-" + secrets.token_urlsafe(32)  # as keys were issued before they carried a tag
    await sync_to_async(ApiKey.objects.create)(name="legacy", key_hash=hash_key(legacy), prefix=legacy[:12])
    cache = KeyCache()
    assert cache.peek(legacy) is NOT_CACHED  # the legacy set is not loaded yet: the lookup waits for it
    principal = await cache.authenticate(legacy)
    assert principal is not None and principal.name == "legacy"
    assert lookups == [hash_key(legacy)]
    for _ in range(100):
        assert await cache.authenticate("sk-gw-" + secrets.token_urlsafe(32)) is None
    assert lookups == [hash_key(legacy)] and legacy_loads == [1]


async def test_the_legacy_set_is_reloaded_in_the_background(legacy_loads: list[int], settings: Any) -> None:
    settings.GATEWAY_LEGACY_KEYS_REFRESH_S = 0.05
    legacy = "sk-gw-" + secrets.token_urlsafe(32)
    cache = KeyCache()
    assert await cache.authenticate(legacy) is None
    await sync_to_async(ApiKey.objects.create)(name="legacy-late", key_hash=hash_key(legacy), prefix=legacy[:12])
    await asyncio.sleep(0.06)
    cache.peek(legacy)  # due: starts the reload; the old set answers meanwhile
    while len(legacy_loads) < 2 or cache._legacy._loading is None or not cache._legacy._loading.done():
        await asyncio.sleep(0.01)
    principal = await cache.authenticate(legacy)
    assert principal is not None and principal.name == "legacy-late"


async def test_a_key_tagged_under_a_former_secret_works_while_it_is_a_fallback(settings: Any) -> None:
    _, key = await sync_to_async(create_api_key)("rotated")
    old = settings.SECRET_KEY
    settings.SECRET_KEY = "the new secret"
    settings.SECRET_KEY_FALLBACKS = [old]
    assert auth.is_issued(key)
    assert await KeyCache().authenticate(key) is not None
    settings.SECRET_KEY_FALLBACKS = []
    assert not auth.is_issued(key)
    assert await KeyCache().authenticate(key) is None


async def test_new_keys_are_issued_in_the_checked_form() -> None:
    row, key = await sync_to_async(create_api_key)("form")
    assert key.startswith("sk-gw2-") and len(key) == key_format.KEY_LENGTH and auth.is_issued(key)
    assert row.prefix == key[:13] and row.prefix.startswith(auth.KEY_PREFIX)
    assert hash_key(key) not in await sync_to_async(auth._legacy_hashes)()


# --- lookups, bounded ----------------------------------------------------------------------------------


async def test_lookups_run_at_most_the_concurrency_at_once(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    settings.GATEWAY_KEY_LOOKUP_CONCURRENCY = 2
    settings.GATEWAY_KEY_LOOKUP_WAIT_S = 30.0
    running, most = 0, 0
    lock = threading.Lock()

    def slow(digest: str) -> Principal | None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return None

    monkeypatch.setattr(auth, "_lookup", slow)
    cache = KeyCache()
    assert await asyncio.gather(*(cache.authenticate(generate_key()) for _ in range(8))) == [None] * 8
    assert most == 2


async def test_a_lookup_without_a_turn_in_time_is_overloaded(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    settings.GATEWAY_KEY_LOOKUP_CONCURRENCY = 1
    settings.GATEWAY_KEY_LOOKUP_WAIT_S = 0.05
    release = threading.Event()

    def stuck(digest: str) -> Principal | None:
        release.wait(5)
        return None

    monkeypatch.setattr(auth, "_lookup", stuck)
    cache = KeyCache()
    first = asyncio.create_task(cache.authenticate(generate_key()))
    await asyncio.sleep(0.01)
    second = generate_key()
    with pytest.raises(auth.KeyLookupOverloaded) as caught:
        await cache.authenticate(second)
    assert (caught.value.status, caught.value.error_type, caught.value.retry_after) == (529, "overloaded_error", 1.0)
    assert cache.peek(second) is NOT_CACHED  # not cached: the next request looks again
    release.set()
    assert await first is None
