"""workers/kv_events/shared.py: a learned prompt's stream entry read back as it was written, any
other entry refused; against the real Redis, what one process learns is kept by another (never
by itself), a process that starts later reads what the stream still holds, the stream's key
expires, a prompt too long stays where it was learned, and a Redis that does not answer leaves
each process with its own."""

from __future__ import annotations

import asyncio
import secrets
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from disagg_project.redis_pipe import RedisPipe
from tests.support.ports import unused_port
from tests.support.redis import redis_url_or_skip
from workers.kv_events.index import Profile
from workers.kv_events.shared import SharedPrompts, entry_fields, read_entry, stream_key

PROFILE: Profile = ("sha256", "", 16)


def as_read(fields: list[Any]) -> list[Any]:
    """The fields as XREAD hands them back: every value as bytes."""
    return [f if isinstance(f, bytes) else str(f).encode() for f in fields]


def test_an_entry_reads_back_as_written() -> None:
    keys = array("Q", [0, 1, 2**64 - 1, 1234567890123])
    fields = as_read(entry_fields("host:1:abc", ("sha256_cbor", "0", 32), 2**63 + 5, keys))
    assert read_entry(fields, max_blocks=4) == ("host:1:abc", ("sha256_cbor", "0", 32), 2**63 + 5, keys)
    assert read_entry(fields, max_blocks=3) is None  # more blocks than an entry may carry


@pytest.mark.parametrize(
    "change",
    [
        {b"a": b"md5"},  # an algorithm the gateway does not reproduce
        {b"b": b"0"},
        {b"b": b"x"},
        {b"m": b"-1"},
        {b"m": str(2**64).encode()},
        {b"k": b""},
        {b"k": b"1234567"},  # not whole 8-byte keys
        {b"s": b"\xff"},  # not UTF-8
    ],
)
def test_an_entry_this_code_does_not_write_is_refused(change: dict[bytes, bytes]) -> None:
    fields = dict(zip(*[iter(as_read(entry_fields("p", PROFILE, 7, array("Q", [1, 2]))))] * 2, strict=True))
    fields.update(change)
    assert read_entry([x for pair in fields.items() for x in pair], max_blocks=8) is None


@given(st.one_of(st.lists(st.one_of(st.binary(max_size=40), st.integers(), st.none(), st.lists(st.binary(), max_size=2))), st.none(), st.binary()))
def test_any_entry_at_all_is_read_or_refused_never_raises(fields: Any) -> None:
    read = read_entry(fields, max_blocks=8)
    assert read is None or (isinstance(read[3], array) and 0 < len(read[3]) <= 8)


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50), st.integers(0, 2**64 - 1), st.text(max_size=20))
def test_every_entry_written_reads_back(keys: list[int], mark: int, seed: str) -> None:
    written = array("Q", keys)
    assert read_entry(as_read(entry_fields("i", ("sha256", seed, 16), mark, written)), max_blocks=50) == ("i", ("sha256", seed, 16), mark, written)


class Process:
    """One gateway process's side of the stream: its `SharedPrompts` and what it kept."""

    def __init__(self, name: str) -> None:
        self.kept: list[tuple[Profile, int, list[int]]] = []
        self.shared = SharedPrompts(lambda profile, mark, keys: self.kept.append((profile, mark, list(keys))), instance=name)
        self.task: asyncio.Task[None] | None = None

    def follow(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.shared.follow())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.shared.aclose()


async def wait_for(condition: Any, timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    url = redis_url_or_skip()
    prefix = f"test-kvshared-{secrets.token_hex(4)}:"
    with override_settings(REDIS_URL=url, REDIS_KEY_PREFIX=prefix, REDIS_TIMEOUT_S=1.0, REDIS_RETRY_S=0.1):
        yield url


async def test_what_one_process_learns_another_keeps_and_a_later_one_reads(redis_prefix: str) -> None:
    a, b, late = Process("a"), Process("b"), Process("late")
    try:
        a.follow()
        b.follow()
        a.shared.publish(PROFILE, 11, array("Q", [5, 6, 7]))
        await wait_for(lambda: b.kept)
        assert b.kept == [(PROFILE, 11, [5, 6, 7])] and b.shared.received == 1
        b.shared.publish(PROFILE, 12, array("Q", [5, 6, 7, 8]))
        await wait_for(lambda: a.kept)
        assert a.kept == [(PROFILE, 12, [5, 6, 7, 8])]  # never its own
        late.follow()  # a process that starts now reads what the stream holds
        await wait_for(lambda: len(late.kept) == 2)
        assert [mark for _, mark, _ in late.kept] == [11, 12]
        assert b.kept == [(PROFILE, 11, [5, 6, 7])]
    finally:
        for process in (a, b, late):
            await process.stop()


@override_settings(KV_EVENTS_SHARED_TTL_S=30.0, KV_EVENTS_SHARED_MAX_BLOCKS=3)
async def test_the_stream_expires_and_a_prompt_too_long_is_not_shared(redis_prefix: str) -> None:
    a, b = Process("a"), Process("b")
    pipe = await RedisPipe.connect(redis_prefix, timeout=1.0, max_in_flight=8)
    try:
        b.follow()
        a.shared.publish(PROFILE, 1, array("Q", [1, 2, 3, 4]))
        a.shared.publish(PROFILE, 2, array("Q", [1, 2, 3]))
        await wait_for(lambda: b.kept)
        assert [mark for _, mark, _ in b.kept] == [2] and a.shared.too_long == 1
        assert await pipe.call(b"XLEN", stream_key()) == 1
        assert 0 < await pipe.call(b"PTTL", stream_key()) <= 30_000
    finally:
        pipe.close()
        await a.stop()
        await b.stop()


async def test_an_entry_that_does_not_parse_is_counted_and_skipped(redis_prefix: str) -> None:
    b = Process("b")
    pipe = await RedisPipe.connect(redis_prefix, timeout=1.0, max_in_flight=8)
    try:
        await pipe.call(b"XADD", stream_key(), b"*", b"i", b"x", b"k", b"junk")
        await pipe.call(b"XADD", stream_key(), b"*", *entry_fields("x", PROFILE, 3, array("Q", [9])))
        b.follow()
        await wait_for(lambda: b.kept)
        assert b.kept == [(PROFILE, 3, [9])] and b.shared.dropped == 1
    finally:
        await pipe.call(b"DEL", stream_key())
        pipe.close()
        await b.stop()


async def test_without_an_answering_redis_each_process_keeps_its_own() -> None:
    with override_settings(REDIS_URL=f"redis://127.0.0.1:{unused_port()}/0", REDIS_TIMEOUT_S=0.2, REDIS_RETRY_S=0.05):
        a = Process("a")
        try:
            a.follow()
            a.shared.publish(PROFILE, 1, array("Q", [1]))  # nowhere to go: dropped, never raised
            await asyncio.sleep(0.3)
            assert a.task is not None and not a.task.done()  # still trying, quietly
            assert a.kept == []
        finally:
            await a.stop()


def test_sharing_is_configured_by_redis_and_the_ttl() -> None:
    with override_settings(REDIS_URL=""):
        assert not SharedPrompts.configured()
    with override_settings(REDIS_URL="redis://127.0.0.1:6379/0", KV_EVENTS_SHARED_TTL_S=0):
        assert not SharedPrompts.configured()
    with override_settings(REDIS_URL="redis://127.0.0.1:6379/0", KV_EVENTS_SHARED_TTL_S=60):
        assert SharedPrompts.configured()
