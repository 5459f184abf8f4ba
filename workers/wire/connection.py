"""aiohttp's connection protocol for worker connections, with the body of a chunked answer
decoded here instead of by aiohttp's response parser: a chunked body's bytes go through one small
decoder (`workers.wire.chunked`) and on to the response's reader, or, while a push is attached
(`workers.wire.push.push_body`), straight to it, in fewer Python calls per relayed token than
aiohttp's own path (why that matters, and the figures: bench/results/2026-12-04-relay-round-6.md).

What stays aiohttp's: the connection pool, TLS, timeouts, and parsing every response head
(`RelayedBodyParser` hands its C parser the head alone, up to the blank line, and takes the body
only when the head it parsed announces a chunked one; after an informational 1xx head it looks
at the next). Anything else (a Content-Length body, a body ending with the connection, no body,
an upgrade) stays with the C parser from there on. A body decoded here ends as the C
parser would end it: the reader gets its end (`feed_eof`), so aiohttp releases the connection
back to the pool, and a new request installs a new parser. Bytes after the end, or malformed
framing, close the connection; a connection lost mid-body fails the reader (and the push) as
aiohttp's own parser would: `ClientPayloadError`.

Relies on aiohttp's `ResponseHandler` calling `self._parser.feed_data`/`feed_eof`/`pause_reading`
and setting `_parser` in `set_response_params`, on its `data_received` doing nothing but feed the
parser when no read timeout (`_read_timeout`, `_read_timeout_handle`) is to be restarted, and on
the connector building protocols with `_factory`, all listed in disagg_project/relied_on.py;
tests/unit/disagg_project/test_relied_on.py, tests/unit/workers/wire/test_connection.py and tests/unit/workers/wire/test_transport.py fail
if those change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.streams import StreamReader

from workers.wire.chunked import ChunkedDecoder, ChunkedFramingError

#: Whether the latest request of the current task went out on a connection that had carried one
#: before (set when the request starts on its connection; `WorkerTransport.send` resets it first).
#: A kept-alive connection may have been closed by the worker just as it was reused: such a request
#: is sent again (workers.wire.transport.WorkerTransport.send).
connection_reused: ContextVar[bool] = ContextVar("connection_reused", default=False)

# What a parser's feed_data returns to aiohttp: the messages (heads) completed, whether the
# connection was upgraded, and the bytes after an upgrade.
Parsed = tuple[Sequence[Any], bool, bytes]
_NOTHING: Parsed = ((), False, b"")
_HEAD_END = b"\r\n\r\n"

# What a RelayedBodyParser does with the bytes it is fed.
_HEAD, _HEAD_PARSER, _BODY, _DONE = range(4)


class BodySink(Protocol):
    """Where a pushed body goes (workers.wire.push.PushedBody)."""

    # The body's bytes as they arrive; False when no more are wanted.
    on_data: Callable[[bytes], bool]

    def body_ended(self, error: BaseException | None) -> None:
        """The body's end (None), or the failure that ended it."""

    def stop(self) -> None:
        """`on_data` wanted no more: nothing more is pushed."""


class RelayedBodyParser:
    """Stands in for aiohttp's parser of one response: heads to `head_parser`, a chunked body to
    a `ChunkedDecoder` whose bytes go to the response's reader or to `sink` (see the module)."""

    __slots__ = ("_head_parser", "_protocol", "_state", "_head_end_seen", "_decoder", "_payload", "sink")

    def __init__(self, head_parser: Any, protocol: ResponseHandler) -> None:
        self._head_parser = head_parser
        self._protocol = protocol
        self._state = _HEAD
        self._head_end_seen = b""  # the head's last bytes so far: its blank line may be split
        self._decoder: ChunkedDecoder | None = None
        self._payload: StreamReader | None = None
        # Set while a push is attached: gets the body's bytes instead of the reader, until its
        # `on_data` returns False. Not a reader: never buffers, never pauses the connection.
        self.sink: BodySink | None = None

    @property
    def decoding(self) -> StreamReader | None:
        """The reader whose body this parser decodes (None when the C parser has it)."""
        return self._payload if self._state == _BODY else None

    def feed_data(self, data: bytes) -> Parsed:
        state = self._state
        if state == _BODY:
            self._body(data)
            return _NOTHING
        if state == _HEAD_PARSER:
            result: Parsed = self._head_parser.feed_data(data)
            return result
        if state == _DONE:
            if data:
                self._violation()
            return _NOTHING
        return self._head(data)

    def _head(self, data: bytes) -> Parsed:
        seen = self._head_end_seen + data
        at = seen.find(_HEAD_END)
        if at < 0:
            self._head_end_seen = seen[-3:]
            result: Parsed = self._head_parser.feed_data(data)
            return result
        cut = at + len(_HEAD_END) - len(self._head_end_seen)
        self._head_end_seen = b""
        messages, upgraded, tail = self._head_parser.feed_data(data[:cut])
        rest = data[cut:]
        if upgraded:  # the bytes after the head belong to the new protocol, as aiohttp returns them
            self._state = _HEAD_PARSER
            return messages, True, tail + rest
        message, payload = messages[-1] if messages else (None, None)
        if message is not None and 100 <= message.code < 200 and message.code != 101:
            # An informational head: the answer's own head follows.
            more = self._head(rest) if rest else _NOTHING
        elif message is None or not (message.chunked and isinstance(payload, StreamReader)):
            self._state = _HEAD_PARSER  # not a chunked body: aiohttp's parser reads the rest
            more = self._head_parser.feed_data(rest) if rest else _NOTHING
        else:
            self._state = _BODY
            self._decoder = ChunkedDecoder()
            self._payload = payload
            if rest:
                self._body(rest)
            return messages, False, tail
        return [*messages, *more[0]], more[1], more[2]

    def _body(self, data: bytes) -> None:
        assert self._decoder is not None and self._payload is not None
        try:
            payload_bytes = self._decoder.feed(data)
        except ChunkedFramingError as exc:
            self._fail(aiohttp.ClientPayloadError(f"malformed chunked body: {exc}"))
            return
        if payload_bytes:
            sink = self.sink
            if sink is None:
                self._payload.feed_data(payload_bytes)
            elif not sink.on_data(payload_bytes):
                self.sink = None  # the push stopped: the rest goes to the reader
                sink.stop()
        if self._decoder.done:
            self._state = _DONE
            self._payload.feed_eof()
            sink, self.sink = self.sink, None
            if sink is not None:
                sink.body_ended(None)
            if self._decoder.leftover:
                self._violation()

    def pause_reading(self) -> None:
        """aiohttp's flow control, its reader being full: its C parser stops in the middle of
        what it was fed. A body decoded here stops at the end of the current read (at most
        asyncio's `max_size`, 256 KiB, past the reader's high-water mark); the connection reads
        nothing more meanwhile either way."""
        if self._state == _HEAD_PARSER:
            self._head_parser.pause_reading()

    def feed_eof(self) -> None:
        """The connection closed (aiohttp's `connection_lost`): a body still in progress is
        incomplete, raised as aiohttp's parser raises it (aiohttp then fails the reader)."""
        if self._state == _BODY:
            error = aiohttp.ClientPayloadError("Response payload is not completed: the connection closed mid-body")
            self._fail(error, close=False)
            raise error
        if self._state in (_HEAD, _HEAD_PARSER):
            self._head_parser.feed_eof()

    def _fail(self, error: BaseException, *, close: bool = True) -> None:
        self._state = _DONE
        if self._payload is not None:
            self._payload.set_exception(error)
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.body_ended(error)
        if close:
            self._violation()

    def _violation(self) -> None:
        """The worker broke HTTP/1.1's framing: this connection is not reused."""
        transport = self._protocol.transport
        if transport is not None:
            transport.close()


class WorkerResponseHandler(ResponseHandler):
    """aiohttp's protocol with a `RelayedBodyParser` in front of each response's parser."""

    def data_received(self, data: bytes) -> None:
        parser: Any = self._parser  # a RelayedBodyParser in aiohttp's HttpParser slot
        if (
            type(parser) is RelayedBodyParser
            and parser._state == _BODY
            and not self._read_timeout
            and self._read_timeout_handle is None
            and data
        ):
            # The bytes of a chunked body decoded here, with no read timeout to restart: what
            # aiohttp's `data_received` would do comes down to feeding the parser, which takes
            # them to its decoder. Straight there: two Python calls fewer per relayed token.
            parser._body(data)
            return
        super().data_received(data)

    # Requests this connection has carried, the current one included.
    requests_carried = 0

    def set_response_params(self, **params: Any) -> None:
        # Called once per request, from the request's own task, as it starts on this connection.
        self.requests_carried += 1
        connection_reused.set(self.requests_carried > 1)
        early_bytes = bool(self._tail)  # bytes before the request: aiohttp's parser sees them alone
        super().set_response_params(**params)
        if not early_bytes and self._parser is not None:
            self._parser = RelayedBodyParser(self._parser, self)  # type: ignore[assignment]  # same duck type


def use_worker_protocol(connector: aiohttp.BaseConnector) -> None:
    """Make `connector` build `WorkerResponseHandler`s for its connections."""
    connector._factory = functools.partial(WorkerResponseHandler, loop=connector._loop)  # type: ignore[assignment]


__all__ = ["BodySink", "connection_reused", "RelayedBodyParser", "use_worker_protocol", "WorkerResponseHandler"]
