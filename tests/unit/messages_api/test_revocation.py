"""The registry of open requests by key (messages_api/revocation.py): a check revokes the requests
of keys deactivated or deleted, only those, refuses their keys to new requests for the key
cache's lifetime, revokes nothing when the database cannot say, keeps one checker for requests
that follow each other, and leaves no task behind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from messages_api import revocation
from messages_api.auth import create_api_key, hash_key
from messages_api.errors import AnthropicError
from messages_api.models import ApiKey
from messages_api.revocation import OpenRequests

pytestmark = pytest.mark.django_db(transaction=True)


class Request:
    def __init__(self) -> None:
        self.revoked = 0

    def revoke(self) -> None:
        self.revoked += 1


async def key(name: str) -> str:
    _, plain = await sync_to_async(create_api_key)(name)
    return hash_key(plain)


async def test_a_check_revokes_only_the_requests_of_revoked_keys() -> None:
    kept, deactivated, deleted = await key("kept"), await key("deactivated"), await key("deleted")
    registry = OpenRequests(interval=3600)
    requests = {digest: [Request(), Request()] for digest in (kept, deactivated, deleted)}
    for digest, pair in requests.items():
        for request in pair:
            registry.add(digest, request)
    await sync_to_async(ApiKey.objects.filter(key_hash=deactivated).update)(active=False)
    await sync_to_async(ApiKey.objects.filter(key_hash=deleted).delete)()

    assert await registry.check() == 4
    assert [r.revoked for r in requests[kept]] == [0, 0]
    assert [r.revoked for r in requests[deactivated] + requests[deleted]] == [1, 1, 1, 1]
    assert registry.open_keys() == 1
    # A new request with a key just found revoked is refused, as the key cache will soon say.
    with pytest.raises(AnthropicError) as refused:
        registry.add(deactivated, Request())
    assert refused.value.status == 401
    for request in requests[kept]:
        registry.discard(request)
    assert registry.open_keys() == 0
    registry._checker.cancel()  # the hour-long interval: not waited for here


async def test_requests_one_after_another_share_one_checker_which_ends_once_none_is_open() -> None:
    registry = OpenRequests(interval=0.05)
    digest = await key("sequential")
    first = Request()
    registry.add(digest, first)
    checker = registry._checker
    registry.discard(first)
    second = Request()
    registry.add(digest, second)  # before the checker's next wake-up: no new task, no cancellation
    assert registry._checker is checker and not checker.done()
    registry.discard(second)
    await asyncio.wait_for(checker, 5)  # its next wake-up finds nothing open
    assert registry._checker is None and not checker.cancelled()


async def test_a_failed_lookup_revokes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = await key("flaky")
    registry = OpenRequests(interval=0.01)
    request = Request()

    def down(hashes: list[str]) -> set[str]:
        raise RuntimeError("database down")

    monkeypatch.setattr(revocation, "_active", down)
    registry.add(digest, request)
    await asyncio.sleep(0.1)  # several checks, each failing
    assert request.revoked == 0 and registry.open_keys() == 1
    registry.discard(request)


async def test_the_periodic_check_ends_a_revoked_keys_request() -> None:
    digest = await key("periodic")
    registry = OpenRequests(interval=0.05)
    request: Any = Request()
    registry.add(digest, request)
    await sync_to_async(ApiKey.objects.filter(key_hash=digest).update)(active=False)
    for _ in range(100):
        if request.revoked:
            break
        await asyncio.sleep(0.02)
    assert request.revoked == 1 and registry.revoked == 1
