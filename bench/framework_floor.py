"""The floor of a request on the gateway's fixed stack: daphne and Channels with nothing of ours.

    .venv/bin/python bench/request_cpu.py --request small --floors     # per request, beside the gateway
    .venv/bin/python bench/relay.py --part paced --burst --floors framework   # in a burst (mode relay)

A measuring instrument, not a product. `bench/floor_proxy.py` answers "how few CPU µs can any
Python relay on asyncio spend per request?" (40-350 µs in `cost_split.py`'s runs); the gateway
spends ~1,850 on a small streamed request (2026-12-06). The user fixed
daphne and Channels, so part of that gap is theirs and out of the gateway's reach. This ASGI
application measures that part: daphne serves it (`python -m daphne bench.framework_floor:application`)
through Channels' ProtocolTypeRouter, URLRouter and a stock `AsyncHttpConsumer`, as the gateway
is served; `FRAMEWORK_FLOOR` picks how much a request does:

    stock    parse the Messages body (orjson) and answer from constants: the same SSE frames a
             4-token streamed answer is made of (message_start ... message_stop, six writes), or
             one JSON message, through Channels' stock AsyncHttpConsumer and daphne's own access
             log (on stdout, from the loop). No worker, no key, no row: what a newcomer's
             consumer on this stack costs.
    answer   the same answer through the shortcuts the gateway takes around the stock path:
             messages dispatched in place (messages_api/consumers/dispatch.py
             `RequestTask.serve_in_place`: no task and `asyncio.wait` per message, no ORM thread
             hop per message), middle frames
             written straight to daphne's request (messages_api/server/body_writer.py), bytes
             sent at once rather than on Twisted's next loop turn and each ASGI message's bytes in
             one send (messages_api/server/direct_write.py), no form parsing of a POSTed body by
             Twisted and no Twisted access line formatted for no one
             (messages_api/server/http_guard.py turns both off), and no daphne access line
             (start daphne with `-v 0`; the gateway writes its own on a thread). daphne and
             Channels as the gateway uses them, and nothing else.
    relay    `answer` plus the least a gateway on this stack must add: send the generation
             worker an OpenAI chat request on a kept-alive connection, read its answer in the connection's receive
             callback (an asyncio Protocol, the gateway's own chunked decoder, as
             `floor_proxy.py reframe` and the gateway's worker connection do), `orjson.loads` each
             SSE data line and write the text delta frames of each read in one write (the
             gateway's own framing functions), or gather the text into one JSON message. Still no
             key, audit row, reservation, limits, metrics or log line.
    relay-aiohttp  the same through aiohttp's client (one pooled session, its stock stream
             reader): what the library under the gateway's worker transport costs as it comes.
             Per token it costs more than the gateway's own path, so it is no floor per token.

`FLOOR_UPSTREAM` is the generation worker's base URL (relay). GET /ready and / answer 200 once
serving, which is what the bench harness and the tests wait for. tests/e2e/test_framework_floor.py
checks that each floor answers what the Anthropic SDK expects.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

# The least Django that Channels' URLRouter needs (its patterns are django.urls'): no apps, no database.
if not settings.configured:
    settings.configure(DEBUG=False, USE_TZ=True)
    django.setup()

import aiohttp  # noqa: E402
from channels.exceptions import StopConsumer  # noqa: E402
from channels.generic.http import AsyncHttpConsumer  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from messages_api.framing import encode_events, text_delta_frame  # noqa: E402  (the gateway's frames)
from messages_api.server.body_writer import BodyWriter, body_writer  # noqa: E402  (and its writer)
from workers.wire.chunked import ChunkedDecoder, ChunkedFramingError  # noqa: E402  (and its decoder)

__all__ = ["application"]

MODE = os.environ.get("FRAMEWORK_FLOOR", "answer")
UPSTREAM = os.environ.get("FLOOR_UPSTREAM", "")

if MODE != "stock":
    # What the gateway's GuardedRequest and GuardedHTTPFactory turn off (messages_api/server/http_guard.py).
    from daphne.http_protocol import HTTPFactory, WebRequest

    _web_request_init = WebRequest.__init__

    def _without_form_parsing(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parsePOSTFormSubmission", False)
        _web_request_init(self, *args, **kwargs)

    WebRequest.__init__ = _without_form_parsing
    HTTPFactory.log = lambda self, request: None

    # Client-bound bytes sent at once, and what one ASGI message writes in one send
    # (messages_api/server/direct_write.py, as GuardedRequest.handle_reply holds the connection).
    from messages_api.server.direct_write import DirectWriteServer, install

    install()
    _handle_reply = WebRequest.handle_reply

    def _handle_reply_in_one_send(self: Any, message: dict[str, Any]) -> None:
        transport = self.channel.transport if self.channel is not None else None
        if not isinstance(transport, DirectWriteServer):
            _handle_reply(self, message)
            return
        transport.hold()
        try:
            _handle_reply(self, message)
        finally:
            transport.release()

    WebRequest.handle_reply = _handle_reply_in_one_send

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _message(model: str, content: list[dict[str, Any]], stop_reason: str | None, output_tokens: int) -> dict[str, Any]:
    return {"id": "msg_floor", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": output_tokens}}


def _opening(model: str) -> bytes:
    return encode_events([
        {"type": "message_start", "message": _message(model, [], None, 0)},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ])


def _closing(stop_reason: str, output_tokens: int) -> bytes:
    return encode_events([
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None}, "usage": {"output_tokens": output_tokens}},
        {"type": "message_stop"},
    ])


class FloorConsumer(AsyncHttpConsumer):
    """POST /v1/messages, answered by `MODE`."""

    _writer: BodyWriter | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if MODE == "stock":
            await super().__call__(scope, receive, send)
            return
        # As the gateway's RequestTask.serve_in_place (no channel layer: one source of messages).
        self.scope, self.channel_layer, self.base_send = scope, None, send
        self._writer = body_writer(send)
        try:
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    await self.http_request(message)
                elif message["type"] == "http.disconnect":
                    await self.http_disconnect(message)
        except StopConsumer:
            pass

    async def send_body(self, body: bytes, *, more_body: bool = False) -> None:
        if more_body and self._writer is not None:
            self._writer(body)
        else:
            await super().send_body(body, more_body=more_body)

    async def handle(self, body: bytes) -> None:
        request = orjson.loads(body)
        model, stream = request["model"], request.get("stream", False)
        if MODE in ("stock", "answer"):
            await self._answer(model, stream)
        else:
            await self._relay(request, model, stream)

    async def _answer(self, model: str, stream: bool) -> None:
        if not stream:
            await self.send_response(200, orjson.dumps(_message(model, [{"type": "text", "text": "a b c d"}], "max_tokens", 4)),
                                     headers=_JSON_HEADERS)
            return
        await self.send_headers(status=200, headers=_SSE_HEADERS)
        await self.send_body(_opening(model), more_body=True)
        for text in ("a", " b", " c", " d"):
            await self.send_body(text_delta_frame(0, text), more_body=True)
        await self.send_body(_closing("max_tokens", 4))

    async def _relay(self, request: dict[str, Any], model: str, stream: bool) -> None:
        chat = orjson.dumps({"model": model, "messages": request["messages"], "max_tokens": request["max_tokens"], "stream": True})
        pieces: list[str] = []
        if stream:
            await self.send_headers(status=200, headers=_SSE_HEADERS)
            await self.send_body(_opening(model), more_body=True)
        writer = self._writer if stream else None
        # The frames of one worker read go out in one write, as the gateway's FrameWriter does.
        on_texts: Callable[[list[str]], None] = (
            (lambda texts: writer(b"".join(text_delta_frame(0, t) for t in texts))) if writer is not None else pieces.extend
        )
        try:
            if MODE == "relay-aiohttp":
                stop_reason, output_tokens = await _relay_aiohttp(chat, on_texts)
            else:
                stop_reason, output_tokens = await _relay_lean(chat, on_texts)
        except (OSError, aiohttp.ClientError):
            # The client sees a stream cut short (no message_stop) or a 502, which a benchmark
            # counts as a failure, rather than waiting for an answer that never ends.
            if stream:
                await self.send_body(b"")
            else:
                await self.send_response(502, b"{}", headers=_JSON_HEADERS)
            return
        if stream:
            await self.send_body(_closing(stop_reason, output_tokens))
        else:
            content = [{"type": "text", "text": "".join(pieces)}]
            await self.send_response(200, orjson.dumps(_message(model, content, stop_reason, output_tokens)), headers=_JSON_HEADERS)


class _Events:
    """The worker's SSE stream, split into events: the content of each chunk, and its stop reason."""

    def __init__(self) -> None:
        self.pending = b""
        self.stop_reason = "end_turn"
        self.tokens = 0

    def feed(self, data: bytes) -> list[str]:
        *events, self.pending = (self.pending + data if self.pending else data).split(b"\n\n")
        texts: list[str] = []
        for event in events:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            for choice in orjson.loads(event[6:]).get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    texts.append(text)
                if choice.get("finish_reason"):
                    self.stop_reason = _STOP_REASONS.get(choice["finish_reason"], "end_turn")
        self.tokens += len(texts)
        return texts


_session: aiohttp.ClientSession | None = None  # relay-aiohttp: one per process, made on the loop at first use


async def _relay_aiohttp(chat: bytes, on_texts: Callable[[list[str]], None]) -> tuple[str, int]:
    global _session
    if _session is None:
        # No bound on connections (aiohttp's default is 100): a burst of 200 streams would
        # otherwise queue behind the pool, which the gateway's (4,096 per endpoint) does not.
        _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    events = _Events()
    async with _session.post(UPSTREAM + "/v1/chat/completions", data=chat, headers={"content-type": "application/json"}) as response:
        async for data in response.content.iter_any():
            texts = events.feed(data)
            if texts:
                on_texts(texts)
    return events.stop_reason, events.tokens


class _WorkerConnection(asyncio.Protocol):
    """relay: one keep-alive connection to the worker, parsed in its receive callback (head, then
    the chunked body with the gateway's own decoder, then SSE events): no streams, no tasks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._head = b""
        self._decoder: ChunkedDecoder | None = None
        self.events = _Events()  # the current answer's events so far (its stop reason, its token count)
        self._on_texts: Callable[[list[str]], None] = lambda texts: None
        self.done: asyncio.Future[None] | None = None
        self.answered = 0  # bytes of the current answer received

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self in _idle:  # the worker closed it while it was idle
            _idle.remove(self)
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the worker closed the connection"))

    def send(self, wire: bytes, on_texts: Callable[[list[str]], None]) -> asyncio.Future[None]:
        self._head, self._decoder, self.events, self._on_texts, self.answered = b"", None, _Events(), on_texts, 0
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the worker closed the connection")
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(wire)
        return self.done

    def data_received(self, data: bytes) -> None:
        self.answered += len(data)
        if self._decoder is None:
            buf = self._head + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._head = buf
                return
            head = buf[:end].lower()
            if head[9:12] != b"200" or b"\r\ntransfer-encoding: chunked" not in head:
                self._fail("the worker's answer is not a 200 chunked stream")
                return
            self._decoder, data = ChunkedDecoder(), buf[end + 4 :]
        try:
            payload = self._decoder.feed(data)
        except ChunkedFramingError:
            self._fail("bad chunked framing")
            return
        if payload:
            texts = self.events.feed(payload)
            if texts:
                self._on_texts(texts)
        if self._decoder.done and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, why: str) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(why))
        if self.transport is not None:
            self.transport.close()


_idle: list[_WorkerConnection] = []  # relay: kept-alive worker connections, last in first out


async def _relay_lean(chat: bytes, on_texts: Callable[[list[str]], None]) -> tuple[str, int]:
    parts = urlsplit(UPSTREAM)
    wire = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (parts.netloc.encode(), len(chat), chat))
    while True:
        reused = bool(_idle)
        if reused:
            connection = _idle.pop()
        else:
            _, connection = await asyncio.get_running_loop().create_connection(_WorkerConnection, parts.hostname, parts.port)
        try:
            await connection.send(wire, on_texts)
        except ConnectionError:
            # A kept-alive connection the worker closed as the request went out (nothing of the
            # answer came): sent again on a new one, as any client with a pool does.
            if reused and connection.answered == 0:
                continue
            raise
        if connection.transport is not None and not connection.transport.is_closing():
            _idle.append(connection)
        return connection.events.stop_reason, connection.events.tokens


class ReadyConsumer(AsyncHttpConsumer):
    async def handle(self, body: bytes) -> None:
        await self.send_response(200, b"{}", headers=_JSON_HEADERS)


application = ProtocolTypeRouter({"http": URLRouter([
    path("v1/messages", FloorConsumer.as_asgi()),  # type: ignore[arg-type]
    path("ready", ReadyConsumer.as_asgi()),  # type: ignore[arg-type]
    path("", ReadyConsumer.as_asgi()),  # type: ignore[arg-type]  # tests/support/gateway.py waits on HEAD /
])})
