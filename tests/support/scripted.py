"""The tests' one scripted HTTP server: a real TCP listener on 127.0.0.1 whose every connection
runs a handler the test writes, from a whole answer per request down to byte by byte.

    async with ScriptedServer(handler) as server:   # in the test's own event loop (unit tests)
        ... server.url, server.connections, server.writers
    with ScriptedServer(answering(respond)) as server:   # in a thread of its own, for sync tests
        ...                                             # and for a gateway in another process

`handler(reader, writer, number)` runs once per connection (`number` counts them from 1); the
connection closes when it returns. A client that hangs up mid-handler ends it quietly.

The handlers most tests need are one call away:
- `answering(respond)`: every request on the connection gets `respond(request)`'s bytes (kept
  alive, unless the answer says `connection: close`);
- `read_request(reader)`: the next request (head and content-length body), None once the client
  closed;
- `response(status, body, ...)`: a content-length framed answer;
- `until_hang_up(reader)`: wait for the client to close its side.

A specialised server stays elsewhere only where it does something this one does not:
tests/support/badworker.py is a long-running process of its own (bench/soak.py drives it for
minutes), so it keeps no per-connection state.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import ssl as ssl_module
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Self

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
Respond = Callable[["Request"], "bytes | Awaitable[bytes]"]


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # the request target, query string included
    fields: list[tuple[str, str]]  # the header fields as sent (names in their own case)
    body: bytes
    raw: bytes  # head and body, as received

    @property
    def headers(self) -> dict[str, str]:
        """The header fields by lower-cased name (the last one wins)."""
        return {name.lower(): value for name, value in self.fields}

    def json(self) -> Any:
        return json.loads(self.body or b"{}")


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on the connection: its head and its content-length body. None when the
    client closed before a whole head; a body cut short raises IncompleteReadError."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head[:-4].decode("latin-1").split("\r\n")
    method, _, rest = lines[0].partition(" ")
    path = rest.rsplit(" ", 1)[0]
    fields = [(name.strip(), value.strip()) for name, _, value in (line.partition(":") for line in lines[1:] if line)]
    length = next((int(value) for name, value in fields if name.lower() == "content-length"), 0)
    body = await reader.readexactly(length) if length else b""
    return Request(method, path, fields, body, head + body)


def response(
    status: int = 200,
    body: bytes = b"",
    *,
    content_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """A whole HTTP/1.1 answer framed by content-length (`headers` go after content-type)."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Status"
    lines = [f"HTTP/1.1 {status} {reason}"]
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_response(status: int, payload: Any, *, headers: Mapping[str, str] | None = None) -> bytes:
    return response(status, json.dumps(payload).encode(), content_type="application/json", headers=headers)


def answering(respond: Respond) -> Handler:
    """A handler answering every request on a connection with `respond(request)` (a function or
    a coroutine function); the connection stays open for the next request unless the answer's
    head says `connection: close`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while (request := await read_request(reader)) is not None:
            answer = respond(request)
            if inspect.isawaitable(answer):
                answer = await answer
            writer.write(answer)
            await writer.drain()
            if b"\r\nconnection: close\r\n" in answer.partition(b"\r\n\r\n")[0].lower() + b"\r\n":
                return

    return handler


async def until_hang_up(reader: asyncio.StreamReader) -> None:
    """Wait until the client has closed the connection (or reset it); whatever it sends meanwhile
    is read and dropped."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass


class ScriptedServer:
    """A TCP server on 127.0.0.1 running `handler(reader, writer, connection_number)` per
    connection. `async with` serves from the running event loop; `with` from a thread of its
    own (handlers then run there: share state with the test through plain attributes)."""

    def __init__(self, handler: Handler, *, ssl: ssl_module.SSLContext | None = None, limit: int = 2**16) -> None:
        self.handler = handler
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self._ssl = ssl
        self._limit = limit
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError, ssl_module.SSLError):
            pass
        except asyncio.CancelledError:
            pass  # stopped by `stop`: this connection's task ends like any other (nothing awaits it)
        finally:
            self._handlers.discard(task)
            writer.close()

    @property
    def url(self) -> str:
        assert self._server is not None, "the server is not started"
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    # -- in the running event loop --

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._ssl, limit=self._limit)
        return self

    async def stop(self) -> None:
        """Stop listening, close every connection and end the handlers still running."""
        assert self._server is not None
        self._server.close()
        for writer in self.writers:
            writer.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- in a thread of its own --

    def start_thread(self) -> Self:
        """Serve from a new thread with its own event loop (what `with` does)."""
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="scripted-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), loop).result(10)
        return self

    def stop_thread(self) -> None:
        loop, thread = self._loop, self._thread
        assert loop is not None and thread is not None
        try:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    def __enter__(self) -> Self:
        return self.start_thread()

    def __exit__(self, *exc: object) -> None:
        self.stop_thread()
