"""A scripted Redis for the client's tests: an asyncio server that reads RESP commands and answers
each with what the test's `answer` returns, so replies can be held back, split, batched, made
errors, or never sent, and the connection dropped mid-flight."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis

Answer = Callable[[list[bytes]], Awaitable[bytes | None] | bytes | None]


def encode(value: Any) -> bytes:
    """A reply in RESP: int → integer, bytes/str → bulk string, list → array, Exception → error."""
    if isinstance(value, Exception):
        return b"-" + str(value).encode() + b"\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(encode(v) for v in value)
    raise TypeError(value)


class FakeRedis:
    """`answer(command)` gives the bytes to write back (None: nothing); `commands` lists what came
    in, `chunks` how it arrived (one entry per read), `connections` how many were accepted."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer = answer or (lambda command: encode(1))
        self.commands: list[list[bytes]] = []
        self.chunks: list[bytes] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"redis://{host}:{port}/0"

    async def __aenter__(self) -> FakeRedis:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.drop()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def drop(self) -> None:
        """Close every connection, as a Redis restart does."""
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        parser = hiredis.Reader()
        while data := await reader.read(65536):
            self.chunks.append(data)
            parser.feed(data)
            while (command := parser.gets()) is not False:
                self.commands.append(command)
                reply = self.answer(command)
                if not isinstance(reply, (bytes, type(None))):
                    reply = await reply
                if reply is not None and not writer.is_closing():
                    writer.write(reply)
