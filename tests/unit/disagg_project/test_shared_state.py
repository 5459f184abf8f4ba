"""disagg_project/shared_state.py: scripts run by their SHA and sent whole when Redis lost them,
a Redis that fails or goes silent answered from the process's own state (counted, retried after
REDIS_RETRY_S), a restarted Redis reconnected to, one connection per event loop, background calls
without a task of their own; against a scripted Redis and the real one."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest
from django.test import override_settings
from prometheus_client import REGISTRY

from disagg_project.shared_state import Script, SharedState
from tests.support.fake_redis import FakeRedis, encode
from tests.support.redis import redis_url_or_skip

SCRIPT = Script("return ARGV[1]")


def fallbacks(reason: str) -> float:
    return REGISTRY.get_sample_value("gateway_shared_state_fallbacks_total", {"reason": reason}) or 0.0


@pytest.fixture(autouse=True)
def quick_retry() -> Iterator[None]:
    with override_settings(REDIS_TIMEOUT_S=0.2, REDIS_RETRY_S=0.05, REDIS_MAX_IN_FLIGHT=256):
        yield


class Scripts:
    """A Redis that runs `return ARGV[1]`; without `loaded` it has no scripts until sent one whole."""

    def __init__(self, loaded: bool = False) -> None:
        self.loaded: set[bytes] = {b"loaded"} if loaded else set()

    def __call__(self, command: list[bytes]) -> bytes:
        if command[0] == b"EVAL":
            self.loaded.add(command[1])
        elif command[0] == b"EVALSHA" and not self.loaded:
            return encode(RuntimeError("NOSCRIPT No matching script. Please use EVAL."))
        elif command[0] == b"PING":
            return encode(b"PONG")
        n = int(command[2])
        return encode(command[3 + n])


async def test_a_script_redis_lost_is_sent_whole_once_then_by_its_sha() -> None:
    scripts = Scripts()
    async with FakeRedis(scripts) as server:
        shared = SharedState(server.url)
        assert await shared.run(SCRIPT, ["k"], ["a"]) == b"a"
        assert await shared.run(SCRIPT, ["k"], ["b"]) == b"b"
        assert [c[0] for c in server.commands] == [b"EVALSHA", b"EVAL", b"EVALSHA"]
        assert server.commands[0][1] == SCRIPT.sha.encode()
        scripts.loaded.clear()  # a restart: the background call gets NOSCRIPT, then sends it whole
        shared.spawn(SCRIPT, ["k"], ["c"])
        await shared.drain()
        assert [c[0] for c in server.commands[3:]] == [b"EVALSHA", b"PING", b"EVAL", b"PING"]
        assert server.commands[-2][-1] == b"c"
        await shared.aclose()


async def test_background_calls_need_no_task_and_leave_with_the_next_check() -> None:
    async with FakeRedis(Scripts(loaded=True)) as server:
        shared = SharedState(server.url)
        await shared.run(SCRIPT, ["k"], ["warm"])
        chunks = len(server.chunks)
        shared.spawn(SCRIPT, ["k"], ["settle"])
        shared.spawn(SCRIPT, ["k"], ["release"])
        assert not shared._background
        assert await shared.run(SCRIPT, ["k"], ["check"]) == b"check"
        assert len(server.chunks) == chunks + 1  # the three in one write
        await shared.aclose()


async def test_a_connection_lost_mid_flight_sends_every_caller_to_its_fallback_then_recovers() -> None:
    held: list[list[bytes]] = []
    # Down for 2 s, not the fixture's 0.05: a loaded machine took longer than 0.05 s from the drop
    # to the "paused" call below, which then found the pause over and tried Redis again.
    with override_settings(REDIS_RETRY_S=2.0):
        await _lost_mid_flight_then_recovered(held)


async def _lost_mid_flight_then_recovered(held: list[list[bytes]]) -> None:
    async with FakeRedis(lambda command: held.append(command)) as server:
        shared = SharedState(server.url)
        before = fallbacks("ConnectionError")
        calls = [asyncio.ensure_future(shared.run(SCRIPT, ["k"], [str(i)])) for i in range(5)]
        while len(held) < 5:
            await asyncio.sleep(0.001)
        shared.spawn(SCRIPT, ["k"], ["background"])
        await asyncio.sleep(0.01)
        server.drop()
        assert await asyncio.gather(*calls) == [None] * 5
        assert fallbacks("ConnectionError") - before == 6  # five checks and the background one
        assert not shared.available
        assert REGISTRY.get_sample_value("gateway_shared_state_up") == 0
        unavailable = fallbacks("unavailable")
        assert await shared.run(SCRIPT, ["k"], ["paused"]) is None
        assert fallbacks("unavailable") == unavailable + 1
        server.answer = Scripts(loaded=True)
        deadline = asyncio.get_running_loop().time() + 30
        while await shared.run(SCRIPT, ["k"], ["back"]) != b"back":  # None until REDIS_RETRY_S is over
            assert asyncio.get_running_loop().time() < deadline, "Redis never tried again"
            await asyncio.sleep(0.05)
        assert server.connections == 2
        assert REGISTRY.get_sample_value("gateway_shared_state_up") == 1
        await shared.aclose()


async def test_a_silent_redis_is_a_fallback_after_the_timeout() -> None:
    async with FakeRedis(lambda command: None) as server:
        shared = SharedState(server.url)
        before = fallbacks("TimeoutError")
        started = asyncio.get_running_loop().time()
        assert await asyncio.gather(*(shared.run(SCRIPT, ["k"], ["x"]) for _ in range(3))) == [None] * 3
        assert 0.2 <= asyncio.get_running_loop().time() - started < 1.5
        assert fallbacks("TimeoutError") - before == 3
        await shared.aclose()


async def test_a_redis_that_restarted_while_idle_is_reconnected_to_without_a_fallback() -> None:
    async with FakeRedis(Scripts(loaded=True)) as server:
        shared = SharedState(server.url)
        assert await shared.run(SCRIPT, ["k"], ["a"]) == b"a"
        server.drop()
        await asyncio.sleep(0.01)
        before = sum(fallbacks(r) for r in ("ConnectionError", "TimeoutError", "unavailable"))
        assert await shared.run(SCRIPT, ["k"], ["b"]) == b"b"
        assert sum(fallbacks(r) for r in ("ConnectionError", "TimeoutError", "unavailable")) == before
        assert server.connections == 2
        await shared.aclose()


async def test_no_redis_at_all_is_a_fallback_not_an_error() -> None:
    shared = SharedState("redis://127.0.0.1:9/0")
    before = fallbacks("ConnectionError")
    assert await shared.run(SCRIPT, ["k"], ["x"]) is None
    shared.spawn(SCRIPT, ["k"], ["x"])  # paused: counted, not sent
    assert fallbacks("ConnectionError") == before + 1
    await shared.aclose()


async def test_a_full_connection_holds_background_calls_in_tasks() -> None:
    held: list[list[bytes]] = []
    async with FakeRedis(lambda command: held.append(command)) as server:
        with override_settings(REDIS_MAX_IN_FLIGHT=2):
            shared = SharedState(server.url)
            first = asyncio.ensure_future(shared.run(SCRIPT, ["k"], ["1"]))
            while not held:
                await asyncio.sleep(0.001)
            for i in range(3):
                shared.spawn(SCRIPT, ["k"], [f"bg{i}"])
            assert len(shared._background) == 2  # one fitted, two wait for room
            await asyncio.sleep(0.01)
            assert len(held) == 2
            for _ in range(100):
                if first.done() and not shared._background:
                    break
                server.writers[0].write(b"".join(encode(c[-1]) for c in held))
                held.clear()
                await asyncio.sleep(0.01)
            assert first.result() == b"1"
            assert not shared._background
            assert [c[-1] for c in server.commands] == [b"1", b"bg0", b"bg1", b"bg2"]
            await shared.aclose()


def test_each_event_loop_has_its_own_connection() -> None:
    url = redis_url_or_skip()
    shared = SharedState(url)
    results: list[object] = []

    def in_a_loop() -> None:
        async def main() -> None:
            results.append(await shared.run(SCRIPT, ["k"], ["hi"]))
            await shared.aclose()

        asyncio.run(main())

    threads = [threading.Thread(target=in_a_loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [b"hi", b"hi"]
    assert not shared._pipes


async def test_the_real_redis_runs_scripts_in_the_foreground_and_background() -> None:
    url = redis_url_or_skip()
    shared = SharedState(url)
    key = f"test-shared-state-{uuid.uuid4().hex}"
    incr = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    expire = Script("return redis.call('PEXPIRE', KEYS[1], ARGV[1])")
    assert await shared.run(incr, [key], [2]) == 2
    for _ in range(100):
        shared.spawn(incr, [key], [1])
    shared.spawn(expire, [key], [60000])
    assert await shared.run(incr, [key], [0]) == 102  # in order: after every background one
    await shared.aclose()


async def test_a_stream_is_read_as_it_grows_on_a_connection_of_its_own() -> None:
    url = redis_url_or_skip()
    shared = SharedState(url)
    key = f"test-shared-state-stream-{uuid.uuid4().hex}"
    add = Script("redis.call('PEXPIRE', KEYS[1], 60000) return redis.call('XADD', KEYS[1], '*', 'f', ARGV[1])")
    assert await shared.read_stream(key, b"0-0", count=10, block_s=0.05) == []  # nothing came
    waiting = asyncio.ensure_future(shared.read_stream(key, b"$", count=10, block_s=5.0))
    await asyncio.sleep(0.05)
    first = await shared.run(add, [key], ["one"])  # the pipelined connection is free while a read blocks
    assert await waiting == [(first, [b"f", b"one"])]
    second = await shared.run(add, [key], ["two"])
    assert await shared.read_stream(key, first, count=10, block_s=0.05) == [(second, [b"f", b"two"])]
    assert await shared.read_stream(key, b"0-0", count=1, block_s=0.05) == [(first, [b"f", b"one"])]
    await shared.aclose()
    assert not shared._readers


async def test_a_stream_read_without_redis_is_a_fallback_not_an_error() -> None:
    shared = SharedState("redis://127.0.0.1:9/0", serves="learned prompts")
    assert await shared.read_stream("k", b"0-0", count=1, block_s=0.05) is None
    assert await shared.read_stream("k", b"0-0", count=1, block_s=0.05) is None  # paused: not tried again
    await shared.aclose()
