"""disagg_project/redis_pipe.py against a scripted Redis (tests/support/fake_redis.py): replies
matched in order out of one pipelined stream, error replies, commands of one turn in one write,
a connection lost or silent mid-flight failing every caller at once, and the bound on commands in
flight."""

from __future__ import annotations

import asyncio
import contextlib
import socketserver
import ssl
import threading
import time
from collections.abc import Iterator

import hiredis
import pytest

from disagg_project.redis_pipe import RedisPipe, ReplyError, parse_url
from tests.support.fake_redis import FakeRedis, encode


def echo(command: list[bytes]) -> bytes:
    return encode(command[1:])


async def test_replies_go_to_their_callers_in_order_however_they_arrive() -> None:
    held: list[bytes] = []

    def answer(command: list[bytes]) -> None:
        held.append(encode(command[1]))
        if len(held) == 50:  # every reply in one stream, cut at odd places
            stream = b"".join(held)
            for i in range(0, len(stream), 7):
                server.writers[0].write(stream[i:i + 7])

    async with FakeRedis(answer) as server:
        pipe = await RedisPipe.connect(server.url, timeout=5, max_in_flight=100)
        replies = await asyncio.gather(*(pipe.call(b"ECHO", str(i)) for i in range(50)))
        assert replies == [str(i).encode() for i in range(50)]
        pipe.close()


async def test_commands_of_one_turn_leave_in_one_write() -> None:
    async with FakeRedis(echo) as server:
        pipe = await RedisPipe.connect(server.url, timeout=5, max_in_flight=100)
        got: list[object] = []
        pipe.send(got.append, b"ECHO", b"a")
        pipe.send(got.append, b"ECHO", b"b")
        assert await pipe.call(b"ECHO", b"c") == [b"c"]
        assert got == [[b"a"], [b"b"]]
        assert len(server.chunks) == 1 and server.chunks[0].count(b"ECHO") == 3
        pipe.close()


async def test_an_error_reply_fails_its_command_only() -> None:
    def answer(command: list[bytes]) -> bytes:
        return encode(RuntimeError("ERR no such thing")) if command[1] == b"bad" else encode(command[1:])

    async with FakeRedis(answer) as server:
        pipe = await RedisPipe.connect(server.url, timeout=5, max_in_flight=100)
        results = await asyncio.gather(pipe.call(b"X", b"bad"), pipe.call(b"X", b"good"), return_exceptions=True)
        assert isinstance(results[0], ReplyError) and str(results[0]) == "ERR no such thing"
        assert results[1] == [b"good"]
        got: list[object] = []
        pipe.send(got.append, b"X", b"bad")
        await pipe.call(b"X", b"sync")
        assert isinstance(got[0], ReplyError)
        assert not pipe.closed
        pipe.close()


async def test_a_connection_lost_mid_flight_fails_every_caller_at_once() -> None:
    async with FakeRedis(lambda command: None) as server:
        pipe = await RedisPipe.connect(server.url, timeout=5, max_in_flight=2)
        got: list[object] = []
        assert pipe.send(got.append, b"X", b"background")
        calls = [asyncio.ensure_future(pipe.call(b"X", str(i))) for i in range(3)]  # two wait for room
        while len(server.commands) < 2:
            await asyncio.sleep(0.001)
        assert pipe.send(got.append, b"X", b"no room") is False
        server.drop()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results), results
        assert len(got) == 1 and isinstance(got[0], ConnectionError)
        assert pipe.closed
        with pytest.raises(ConnectionError):
            await pipe.call(b"X", b"after")


async def test_a_silent_redis_fails_every_caller_after_the_timeout() -> None:
    async with FakeRedis(lambda command: None) as server:
        pipe = await RedisPipe.connect(server.url, timeout=0.1, max_in_flight=10)
        got: list[object] = []
        pipe.send(got.append, b"X", b"1")
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(pipe.call(b"X", b"2"), pipe.call(b"X", b"3"), return_exceptions=True)
        assert 0.1 <= asyncio.get_running_loop().time() - started < 1
        assert all(isinstance(r, TimeoutError) for r in results)
        assert isinstance(got[0], TimeoutError)
        assert pipe.closed


async def test_a_loop_busy_past_the_timeout_is_not_taken_for_a_silent_redis() -> None:
    with threaded_redis() as url:
        pipe = await RedisPipe.connect(url, timeout=0.05, max_in_flight=10)
        assert await pipe.call(b"X", b"0") == 1  # the deadline's timer is set
        call = asyncio.ensure_future(pipe.call(b"X", b"1"))
        await asyncio.sleep(0)  # the command is given
        time.sleep(0.06)  # the timer is due before the command is written
        # The turn that writes it runs long after, then the timer: the reply sits unread.
        asyncio.get_running_loop().call_soon(time.sleep, 0.1)
        assert await call == 1
        assert not pipe.closed
        pipe.close()


@contextlib.contextmanager
def threaded_redis() -> Iterator[str]:
    """A Redis answering 1 to everything from a thread of its own (not this test's loop)."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            parser = hiredis.Reader()
            while data := self.request.recv(65536):
                parser.feed(data)
                while parser.gets() is not False:
                    self.request.sendall(b":1\r\n")

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"redis://127.0.0.1:{server.server_address[1]}/0"
        finally:
            server.shutdown()


async def test_commands_in_flight_are_bounded() -> None:
    held: list[list[bytes]] = []
    async with FakeRedis(lambda command: held.append(command)) as server:
        pipe = await RedisPipe.connect(server.url, timeout=5, max_in_flight=3)
        calls = [asyncio.ensure_future(pipe.call(b"X", str(i))) for i in range(7)]
        await asyncio.sleep(0.05)
        assert len(held) == 3 and pipe.in_flight == 3
        assert pipe.send(lambda reply: None, b"X", b"no room") is False
        calls[4].cancel()  # a waiter that leaves gives up its turn
        for _ in range(2):
            server.writers[0].write(b"".join(encode(c[1]) for c in held))
            held.clear()
            await asyncio.sleep(0.05)
            assert pipe.in_flight <= 3
        assert [c.result() for i, c in enumerate(calls) if i != 4 and c.done()] == [b"0", b"1", b"2", b"3", b"5", b"6"]
        assert calls[4].cancelled()
        pipe.close()


async def test_a_cancelled_caller_leaves_the_stream_in_step() -> None:
    release = asyncio.Event()

    async def answer(command: list[bytes]) -> bytes:
        if command[1] == b"slow":
            await release.wait()
        return encode(command[1])

    async with FakeRedis(answer) as server:
        pipe = await RedisPipe.connect(server.url, timeout=5, max_in_flight=10)
        slow = asyncio.ensure_future(pipe.call(b"X", b"slow"))
        await asyncio.sleep(0.01)
        slow.cancel()
        nxt = asyncio.ensure_future(pipe.call(b"X", b"next"))
        release.set()
        assert await nxt == b"next"
        pipe.close()


async def test_connect_logs_in_and_selects_the_database() -> None:
    async with FakeRedis(lambda command: encode(b"OK") if command[0] in (b"AUTH", b"SELECT") else echo(command)) as server:
        url = server.url.replace("redis://", "redis://me:s%40cret@").replace("/0", "/3")
        pipe = await RedisPipe.connect(url, timeout=5, max_in_flight=10)
        assert server.commands[:2] == [[b"AUTH", b"me", b"s@cret"], [b"SELECT", b"3"]]
        pipe.close()


async def test_a_refused_login_or_no_server_is_a_connection_error() -> None:
    async with FakeRedis(lambda command: encode(RuntimeError("WRONGPASS invalid"))) as server:
        with pytest.raises(ConnectionError, match="WRONGPASS"):
            await RedisPipe.connect(server.url.replace("redis://", "redis://:x@"), timeout=5, max_in_flight=10)
    with pytest.raises(ConnectionError):
        await RedisPipe.connect("redis://127.0.0.1:9/0", timeout=5, max_in_flight=10)


def test_urls_read_as_redis_py_reads_them() -> None:
    plain = parse_url("redis://10.0.0.9:6380/2")
    assert (plain.host, plain.port, plain.db, plain.password, plain.ssl) == ("10.0.0.9", 6380, 2, None, None)
    defaults = parse_url("redis://h")
    assert (defaults.port, defaults.db, defaults.username) == (6379, 0, None)
    secret = parse_url("redis://:pw@h/0")
    assert (secret.username, secret.password) == (None, "pw")
    tls = parse_url("rediss://h?ssl_cert_reqs=none")
    assert tls.ssl is not None and tls.ssl.verify_mode == ssl.CERT_NONE
    unix = parse_url("unix:///run/redis.sock?db=4")
    assert (unix.path, unix.db) == ("/run/redis.sock", 4)
    with pytest.raises(ValueError):
        parse_url("http://h")
