"""Raw-ASGI plumbing: reading bodies, answering JSON, and racing work against disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, Final, TypeVar

import orjson

from .error_answers import SimError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

T = TypeVar("T")

JSON_HEADERS: Final = (b"content-type", b"application/json")
SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]


class ClientDisconnected(Exception):
    """Raised by `read_body` when the client goes away before its body has arrived."""


class Disconnected:
    """Sentinel type of DISCONNECTED: the client left and the work was cancelled."""

    def __repr__(self) -> str:
        return "DISCONNECTED"


DISCONNECTED: Final = Disconnected()


async def read_body(receive: Receive) -> bytes:
    """Reads an HTTP body from an ASGI connection."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [JSON_HEADERS, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: Any) -> None:
    await send_bytes(send, status, orjson.dumps(payload))


async def send_error(send: Send, error: SimError) -> None:
    await send_bytes(send, error.status, error.body())


async def _wait_for_disconnect(receive: Receive) -> None:
    # Only call once the body has been read: from then on uvicorn's receive() blocks until
    # the client disconnects (or the response is complete).
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(
    receive: Receive, work: Coroutine[Any, Any, T]
) -> T | Disconnected:
    """Runs `work` until it finishes or the client disconnects, whichever comes first.

    On a disconnect the work is cancelled and awaited (so its cleanup runs) and DISCONNECTED
    is returned. If the work finished, its result is returned (or its exception raised), even
    if the disconnect arrived in the same instant: a completed answer counts as completed.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - the client is gone; a cleanup error has no one to reach
        pass
    return DISCONNECTED
