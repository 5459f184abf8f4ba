"""A worker response's body, read or pushed: the one module that reaches into aiohttp's response
reader (and the connection under it) to do so.

    read = body_reader(response)                          # the next bytes as they arrived, b"" at the end
    push = push_body(response, on_data, on_end)           # or: each arrival to on_data, in the receive callback
    push.pause_reading(); push.resume_reading()           # backpressure while pushed
    push.stop()                                           # the rest, if any, is for body_reader

`WorkerTransport.send` (`workers.wire.transport`) answers with a `ResponseStream` behind the httpx
response; both functions find it there. A failed connection reaches the reader as the httpx error
`WorkerTransport`'s mapping gives it (the `map_error` each stream is made with), after the bytes
that arrived before it, and never names the worker's address.

Every aiohttp internal used here (`StreamReader._waiter`, `_buffer`, `_eof`, `_exception`,
`_low_water`, `_protocol`, `_read_nowait`; the protocol's `_parser`, `_reading_paused`,
`transport`) and asyncio's selector transport's `max_size` are listed in
disagg_project/relied_on.py: tests/unit/disagg_project/test_relied_on.py fails if one disappears,
tests/unit/workers/wire/test_transport.py and tests/e2e/test_stream_fairness.py if one changes meaning. The
connection's own protocol and parser (the other aiohttp internals) are `workers.wire.connection`'s.

Why pushed, and the figures: bench/results/2026-12-03-relay-round-4.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx

from workers.wire.connection import RelayedBodyParser

#: The most a pushed body's connection reads at once (see PushedBody).
PUSH_READ_BYTES = 64 * 1024

#: The request a failure's httpx exception names (`exc.request`), built only when one fails.
RequestOf = Callable[[], httpx.Request]
#: The httpx exception for an aiohttp one (None for anything else): `workers.wire.transport`'s.
MapError = Callable[[BaseException], httpx.TransportError | None]


class ResponseStream(httpx.AsyncByteStream):
    """The body of one aiohttp response behind an httpx response: read, iterated, or pushed
    (`push_body`); `aclose` returns its connection to the pool if it was read to its end, and
    closes it otherwise (aiohttp's rule)."""

    def __init__(self, response: aiohttp.ClientResponse, request_of: RequestOf, map_error: MapError) -> None:
        self._response = response
        self._request_of = request_of
        self._map_error = map_error
        self._content = response.content
        self._failed: httpx.TransportError | None = None  # raised by the next read()

    async def read(self) -> bytes:
        """The body's next bytes as they arrived, joined (b"" at its end); httpx's mapped error
        when the connection failed, after the bytes that arrived before it.

        What `__aiter__` does, as one call: a stream read one token at a time spends most of its
        Python time per token in the layers between the socket and the reader (httpx's
        `aiter_raw` and this class's generator are two of them), so ChunkStream calls this."""
        if self._failed is not None:
            raise self._failed
        content = self._content
        try:
            return await content.readany()  # whatever arrived, joined: fewer, larger chunks
        except Exception as exc:
            mapped = self._map_error(exc)
            if mapped is None:
                raise
            mapped.request = self._request_of()
            # aiohttp raises a lost connection as soon as it has seen it, even while bytes that
            # arrived before it are still buffered: a dying worker's last tokens belong to the
            # answer, so hand them over first.
            leftover = content._read_nowait(-1) if content._buffer else b""
            if leftover:
                self._failed = mapped
                return leftover
            raise mapped from None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def aclose(self) -> None:
        self._response.release()


class PushedBody:
    """A response body being pushed (`push_body`): it stands in for the future aiohttp's
    `StreamReader` wakes when body bytes arrive, so that they reach `on_data` from the
    connection's own receive callback, synchronously: a token relayed by awaiting the reader takes
    a future, a loop callback and a task step to resume the reading task through every `await`
    between it and the client; pushed, it is a call.

    aiohttp wakes its reader with `set_result(None)` (bytes, or the end of the body) and
    `set_exception(exc)` (the connection failed); `done()` is all it asks of the future
    otherwise.

    A chunked body decoded by `workers.wire.connection.RelayedBodyParser` (a worker's stream,
    nearly always) is pushed from there instead: the parser calls `on_data` with the body's bytes
    and `body_ended` at its end (this is its `BodySink`), and the reader is left alone."""

    __slots__ = (
        "_content", "_request_of", "_map_error", "on_data", "_on_end", "_finished", "_low_water", "_transport",
        "_max_size", "_parser",
    )

    def __init__(
        self,
        stream: ResponseStream,
        on_data: Callable[[bytes], bool],
        on_end: Callable[[BaseException | None], None],
        parser: RelayedBodyParser | None = None,
    ) -> None:
        content = self._content = stream._content
        self._request_of = stream._request_of
        self._map_error = stream._map_error
        self.on_data = on_data
        self._on_end = on_end
        self._finished = False
        self._parser = parser  # the parser that pushes (see `attach`); None: the reader wakes us
        self._low_water = content._low_water
        if parser is None:
            # Reading what was fed makes the reader resume its protocol, which feeds its parser an
            # empty buffer: from inside the parser's own callback (here) that re-entered the C
            # parser, which then never released the outer buffer (each received chunk leaked).
            # The reader is drained at every feed, so it never pauses its protocol and needs no
            # resume: a negative low-water mark keeps it from trying while pushes run. Restored
            # by `stop`.
            content._low_water = -1
        # A worker's burst (an unpaced stream, or tokens that queued up) comes as reads of up to
        # 256 KiB (asyncio's `max_size`), each relayed in one callback: it would hold the loop for
        # every event in it, keeping other streams and this client's own hang-up waiting. While
        # pushes run, the connection reads at most PUSH_READ_BYTES at a time (about 70 chat
        # chunks; a paced stream's token is one small read either way). Restored by `stop`.
        transport: Any = getattr(content._protocol, "transport", None)
        self._transport = transport
        self._max_size = getattr(transport, "max_size", None)
        if isinstance(self._max_size, int):
            transport.max_size = min(self._max_size, PUSH_READ_BYTES)

    def done(self) -> bool:
        return self._finished

    def set_result(self, _result: None) -> None:
        """aiohttp's reader: bytes arrived, or the body's end."""
        content = self._content
        content._waiter = None
        if self._take_what_arrived():
            content._waiter = self  # type: ignore[assignment]  # the next bytes come here too

    def _take_what_arrived(self) -> bool:
        """What the reader holds, to `on_data`; then its end or its failure, if that came too.
        True while the push goes on."""
        content = self._content
        if content._buffer and not self.on_data(content._read_nowait(-1)):
            self.stop()  # on_data wants no more
            return False
        if self._finished:
            return False
        if content._exception is not None:
            self.set_exception(content._exception)
            return False
        if content._eof and not content._buffer:
            self.stop()
            self._on_end(None)
            return False
        return True

    def set_exception(self, exc: BaseException) -> None:
        """aiohttp's reader: the connection failed. `on_end` gets httpx's error for it."""
        self._content._waiter = None
        if self._finished:
            return
        self.stop()
        mapped = self._map_error(exc)
        if mapped is None:
            self._on_end(exc)  # not a connection failure: raised as it is, as a read would
            return
        mapped.request = self._request_of()
        self._on_end(mapped)

    def body_ended(self, error: BaseException | None) -> None:
        """From the parser that pushes: the body's end, or what failed it."""
        if error is not None:
            self.set_exception(error)
        elif not self._finished:
            self.stop()
            self._on_end(None)

    def attach(self) -> None:
        """Take the body from the parser: what its reader holds already first, then every read."""
        assert self._parser is not None
        if self._take_what_arrived():
            self._parser.sink = self

    def pause_reading(self) -> None:
        """Backpressure: the connection reads nothing more until `resume_reading` (the bytes of
        the read being pushed still go on; a read is at most PUSH_READ_BYTES)."""
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        """The connection reads again (from the next loop turn: nothing is pushed from here)."""
        if self._transport is not None:
            self._transport.resume_reading()

    def stop(self) -> None:
        """No more pushes (idempotent); the body's rest, if any, is left to a plain read."""
        if self._finished:
            return
        self._finished = True
        if self._parser is not None and self._parser.sink is self:
            self._parser.sink = None
        content: Any = self._content
        if content._waiter is self:
            content._waiter = None
        content._low_water = self._low_water
        if isinstance(self._max_size, int):
            self._transport.max_size = self._max_size


def push_body(
    response: httpx.Response,
    on_data: Callable[[bytes], bool],
    on_end: Callable[[BaseException | None], None],
) -> PushedBody | None:
    """Deliver `response`'s body as it arrives: `on_data(bytes)` from the connection's receive
    callback (what has already arrived, at once, from here), until it returns False; then
    `on_end(None)` at the body's end, or `on_end(error)` when the connection fails (httpx's
    mapped error, as `read` raises it). Neither may raise. Returns the push, to `stop()` (the rest
    of the body is then for `body_reader`); None for a response of another transport (read it
    with `body_reader`)."""
    stream = response.stream
    if not isinstance(stream, ResponseStream) or stream._failed is not None:
        return None
    content = stream._content
    if content._waiter is not None:
        raise RuntimeError("the response body is already being read")
    parser = getattr(content._protocol, "_parser", None)
    if isinstance(parser, RelayedBodyParser) and parser.decoding is content:
        waiter = PushedBody(stream, on_data, on_end, parser)
        waiter.attach()
        return waiter
    waiter = PushedBody(stream, on_data, on_end)
    if content._exception is not None:
        # What arrived before the failure, first.
        if not content._buffer or on_data(content._read_nowait(-1)):
            waiter.set_exception(content._exception)
    else:
        waiter.set_result(None)  # what already arrived, or the end; else waits for the next bytes
        protocol: Any = content._protocol
        if not waiter.done() and protocol._reading_paused:
            # What arrived before the push filled the reader past its high-water mark, so aiohttp
            # stopped reading; the reader would resume it once read below its low-water mark,
            # which pushes disable (see PushedBody). Here, outside the parser's callback, it is
            # safe to resume (its parser is fed what it held, so pushes may come from here).
            protocol.resume_reading()
    return waiter


def body_reader(response: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """A function returning the next raw bytes of `response`'s body (b"" at its end): the
    transport's own read for its responses, else one step of `aiter_raw()` (another transport,
    in tests)."""
    stream = response.stream
    if isinstance(stream, ResponseStream):
        return stream.read
    chunks = response.aiter_raw()

    async def next_chunk() -> bytes:
        return await anext(chunks, b"")

    return next_chunk


__all__ = [
    "body_reader",
    "MapError",
    "push_body",
    "PUSH_READ_BYTES",
    "PushedBody",
    "RequestOf",
    "ResponseStream",
]
