"""messages_api/server/send_queue.py: a stream's middle frames off daphne, queued without waiting
and sent in order, with the worker's stream paused while too many wait."""

from __future__ import annotations

import asyncio

import pytest

from messages_api.server.send_queue import SendQueue


class SlowClient:
    """An awaitable `send` that finishes one body each time `take()` is called."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self._turn = asyncio.Semaphore(0)
        self.fail: Exception | None = None

    async def send(self, body: bytes) -> None:
        await self._turn.acquire()
        if self.fail is not None:
            raise self.fail
        self.sent.append(body)

    def take(self, n: int = 1) -> None:
        for _ in range(n):
            self._turn.release()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_frames_are_sent_in_order_joined_while_one_send_is_under_way() -> None:
    client = SlowClient()
    queue = SendQueue(client.send)
    queue(b"a")
    await settle()  # the first send is under way
    queue(b"b")
    queue(b"c")
    client.take(2)
    await queue.flush()
    assert client.sent == [b"a", b"bc"]


async def test_the_source_is_paused_past_the_limit_and_resumed_at_half() -> None:
    client = SlowClient()
    queue = SendQueue(client.send, limit=10)
    calls: list[str] = []
    queue.throttle(lambda: calls.append("pause"), lambda: calls.append("resume"))
    queue(b"x" * 6)
    queue(b"x" * 6)  # 12 bytes wait
    assert calls == ["pause"]
    queue(b"x" * 6)  # paused once only
    assert calls == ["pause"]
    client.take()
    await settle()
    assert calls == ["pause", "resume"]  # everything that waited went in one send
    assert client.sent == [b"x" * 18]


async def test_what_send_raised_ends_the_relay_and_resumes_its_source() -> None:
    client = SlowClient()
    queue = SendQueue(client.send, limit=4)
    calls: list[str] = []
    queue.throttle(lambda: calls.append("pause"), lambda: calls.append("resume"))
    client.fail = ConnectionError("the client is gone")
    queue(b"12345")
    client.take()
    await settle()
    assert calls == ["pause", "resume"]  # the relay goes on, to meet the error
    with pytest.raises(ConnectionError):
        queue(b"more")
    with pytest.raises(ConnectionError):
        await queue.flush()


async def test_close_drops_what_waits() -> None:
    client = SlowClient()
    queue = SendQueue(client.send)
    queue(b"a")
    queue.close()
    await queue.flush()
    assert client.sent == []
