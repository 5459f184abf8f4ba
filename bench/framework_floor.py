"""The floor of a request on the gateway's fixed stack: daphne and Channels with nothing of ours.

    .venv/bin/python bench/request_cpu.py --request small --floors     # measured beside the gateway

A measuring instrument, not a product. `bench/floor_proxy.py` answers "how few CPU µs can any
Python relay on asyncio spend per request?" (~40 µs); the gateway spends ~1,600. The user fixed
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
             messages dispatched in place (messages_api/consumers.py `_dispatch_directly`: no task
             and `asyncio.wait` per message, no ORM thread hop per message), middle frames
             written straight to daphne's request (messages_api/server/body_writer.py), no form
             parsing of a POSTed body by Twisted and no Twisted access line formatted for no one
             (messages_api/server/http_guard.py turns both off), and no daphne access line
             (start daphne with `-v 0`; the gateway writes its own on a thread). daphne and
             Channels as the gateway uses them, and nothing else.
    relay    `answer` plus the least a gateway on this stack must add: send the generation worker an OpenAI chat
             request over aiohttp (the library under the gateway's worker transport, one pooled
             session), read its SSE stream, `orjson.loads` each data line and write a text delta
             frame per content chunk (the gateway's own framing functions), or gather the text into
             one JSON message. Still no key, audit row, reservation, limits, metrics or log line.

`FLOOR_UPSTREAM` is the generation worker's base URL (relay). GET /ready and / answer 200 once
serving, which is what the bench harness and the tests wait for. tests/e2e/test_framework_floor.py
checks that each floor answers what the Anthropic SDK expects.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

# The least Django that Channels' URLRouter needs (its patterns are django.urls'): no apps, no database.
if not settings.configured:
    settings.configure(DEBUG=False, USE_TZ=True)
    django.setup()

import aiohttp  # noqa: E402
from channels.generic.http import AsyncHttpConsumer  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from channels.exceptions import StopConsumer  # noqa: E402

from messages_api.framing import encode_events, text_delta_frame  # noqa: E402  (the gateway's frames)
from messages_api.server.body_writer import BodyWriter, body_writer  # noqa: E402  (and its writer)

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

    session: aiohttp.ClientSession | None = None  # one per process, made on the loop at first use
    _writer: BodyWriter | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if MODE == "stock":
            await super().__call__(scope, receive, send)
            return
        # As the gateway's ApiConsumer._dispatch_directly (no channel layer: one source of messages).
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
        if FloorConsumer.session is None:
            # No bound on connections (aiohttp's default is 100): a burst of 200 streams would
            # otherwise queue behind the pool, which the gateway's (4,096 per endpoint) does not.
            FloorConsumer.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        chat = {"model": model, "messages": request["messages"], "max_tokens": request["max_tokens"], "stream": True}
        pieces: list[str] = []
        stop_reason, output_tokens, pending = "end_turn", 0, b""
        async with FloorConsumer.session.post(UPSTREAM + "/v1/chat/completions", data=orjson.dumps(chat),
                                              headers={"content-type": "application/json"}) as response:
            if stream:
                await self.send_headers(status=200, headers=_SSE_HEADERS)
                await self.send_body(_opening(model), more_body=True)
            async for data in response.content.iter_any():
                pending += data
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    choices = orjson.loads(event[6:]).get("choices") or ()
                    for choice in choices:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            output_tokens += 1
                            if stream:
                                await self.send_body(text_delta_frame(0, text), more_body=True)
                            else:
                                pieces.append(text)
                        if choice.get("finish_reason"):
                            stop_reason = _STOP_REASONS.get(choice["finish_reason"], "end_turn")
        if stream:
            await self.send_body(_closing(stop_reason, output_tokens))
        else:
            content = [{"type": "text", "text": "".join(pieces)}]
            await self.send_response(200, orjson.dumps(_message(model, content, stop_reason, output_tokens)), headers=_JSON_HEADERS)


class ReadyConsumer(AsyncHttpConsumer):
    async def handle(self, body: bytes) -> None:
        await self.send_response(200, b"{}", headers=_JSON_HEADERS)


application = ProtocolTypeRouter({"http": URLRouter([
    path("v1/messages", FloorConsumer.as_asgi()),  # type: ignore[arg-type]
    path("ready", ReadyConsumer.as_asgi()),  # type: ignore[arg-type]
    path("", ReadyConsumer.as_asgi()),  # type: ignore[arg-type]  # tests/support/gateway.py waits on HEAD /
])})
