"""What the tests of the worker transport (tests/unit/workers/wire/test_transport.py) and of its connection
protocol (tests/unit/workers/wire/test_connection.py) share: a transport that is closed after the test,
one request read to its end, the scripted server's usual answer, and a receiver for pushed
bodies. The servers themselves are tests/support/scripted.py's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from tests.support.scripted import answering, response
from workers.wire.transport import WorkerTransport


def ok(body: bytes = b"hello") -> bytes:
    """A 200 with `body`, framed by content-length."""
    return response(200, body)


# A handler (and, awaited from another handler, the rest of a connection): every request gets ok().
answer_every_request = answering(lambda _: ok())


@contextlib.asynccontextmanager
async def worker_transport(**options: Any) -> AsyncIterator[WorkerTransport]:
    transport = WorkerTransport(**options)
    try:
        yield transport
    finally:
        await transport.aclose()


async def fetch(
    transport: WorkerTransport, url: str, *, timeout: float = 5.0, body: bytes = b"{}", via_httpx: bool = False
) -> httpx.Response:
    """POST `body` and read the whole answer: through `send`, as the gateway's worker calls go
    (workers.wire.client), or with `via_httpx` through httpx's transport interface."""
    if via_httpx:
        request = httpx.Request("POST", url, content=body, extensions={"timeout": httpx.Timeout(timeout).as_dict()})
        answer = await transport.handle_async_request(request)
    else:
        answer = await transport.send("POST", url, {"content-type": "application/json"}, body, timeout, timeout, timeout)
    await answer.aread()
    return answer


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


class Pushed:
    """What `push_body` delivered: the bytes, in order (only their count with `keep=False`), and
    how it ended."""

    def __init__(self, stop_after: int | None = None, *, keep: bool = True) -> None:
        self.data: list[bytes] = []
        self.received = 0
        self.keep = keep
        self.ended = asyncio.Event()
        self.error: BaseException | None = None
        self.stop_after = stop_after

    def on_data(self, data: bytes) -> bool:
        self.received += len(data)
        if self.keep:
            self.data.append(data)
        return self.stop_after is None or len(self.data) < self.stop_after

    def on_end(self, error: BaseException | None) -> None:
        assert not self.ended.is_set(), "on_end called twice"
        self.error = error
        self.ended.set()
