#!/usr/bin/env python
"""The floor of a Python relay: a minimal HTTP/1.1 proxy on plain asyncio, in front of one worker.

    .venv/bin/python bench/floor_proxy.py --mode pipe --upstream http://127.0.0.1:8001 [--uvloop]
    .venv/bin/python bench/floor_proxy.py --mode reframe --upstream http://127.0.0.1:8001 [--uvloop]

A measuring instrument for `bench/relay.py --part paced --floors ...`, not a product: it answers
"how few CPU µs per relayed token can ANY Python relay on asyncio spend?", next to the gateway and
the Rust routers in the same run. Everything is Protocol callbacks (no streams, no tasks per
token). Each client connection is pinned to one keep-alive connection to the worker, opened on
its first request; the two live and die together (no pool, no retries, no timeouts, no auth).

    pipe      forwards the client's request (head + Content-Length body) unchanged and writes the
              worker's response bytes to the client from the worker protocol's `data_received`,
              unparsed: below any real proxy, which must at least find the end of a response.
    reframe   the least a gateway must do per token: takes an Anthropic Messages request, sends
              the worker an OpenAI chat request, then per worker read decodes the chunked
              framing (the gateway's own decoder), splits SSE events, `orjson.loads` each data
              line and writes one chunk-framed Anthropic `content_block_delta` frame per content
              chunk (the gateway's own framing functions), with `message_start`/
              `content_block_start` before and `content_block_stop`/`message_delta`/
              `message_stop` after.

Prints `floor_proxy listening on http://HOST:PORT` once it serves (the harness waits for it).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from messages_api.framing import encode_events, text_delta_frame  # noqa: E402  (the gateway's frames)
from workers.wire.chunked import ChunkedDecoder, ChunkedFramingError  # noqa: E402  (and its decoder)

_REFRAME_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_LAST_CHUNK = b"0\r\n\r\n"


def _chunk(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def _content_length(head: bytes) -> int:
    lower = head.lower()
    i = lower.find(b"\r\ncontent-length:")
    if i < 0:
        return 0
    j = lower.find(b"\r\n", i + 2)
    return int(lower[i + 17 : j if j >= 0 else len(lower)])


class Client(asyncio.Protocol):
    """One client connection: reads requests one at a time, hands each to its worker connection."""

    def __init__(self, mode: str, host: str, port: int) -> None:
        self.mode = mode
        self.host = host
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.upstream: Upstream | None = None
        self._connecting = False
        self._buf = b""
        self._head = b""
        self._need = -1  # body bytes still expected; -1 while reading a head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()

    # Flow control: a slow client pauses the worker connection's reads (never hit when paced).
    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        while True:
            if self._need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                self._head = buf[: end + 4]
                self._need = _content_length(self._head)
                buf = buf[end + 4 :]
            if len(buf) < self._need:
                break
            body, buf = buf[: self._need], buf[self._need :]
            self._need = -1
            self._request(self._head, body)
        self._buf = buf

    def _request(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        if self.mode == "pipe":
            wire = head + body
        else:
            try:
                wire = self._chat_request(body)
            except (ValueError, KeyError, TypeError):
                self.transport.write(_BAD_REQUEST)
                self.transport.close()
                return
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.start()
            self.upstream.transport.write(wire)
        elif not self._connecting:
            self._connecting = True
            asyncio.get_running_loop().create_task(self._connect(wire))

    def _chat_request(self, body: bytes) -> bytes:
        """The Anthropic request as an OpenAI chat request (per request, not per token)."""
        req: dict[str, Any] = orjson.loads(body)
        messages = []
        for m in req["messages"]:
            content = m["content"]
            if not isinstance(content, str):
                content = "".join(b["text"] for b in content if b.get("type") == "text")
            messages.append({"role": m["role"], "content": content})
        if isinstance(req.get("system"), str):
            messages.insert(0, {"role": "system", "content": req["system"]})
        chat = orjson.dumps({"model": req["model"], "max_tokens": req["max_tokens"], "stream": True,
                             "messages": messages})
        return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %b:%d\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (self.host.encode(), self.port, len(chat), chat))

    async def _connect(self, wire: bytes) -> None:
        assert self.transport is not None
        upstream: Upstream = PipeUpstream(self.transport) if self.mode == "pipe" else ReframeUpstream(self.transport)
        try:
            await asyncio.get_running_loop().create_connection(lambda: upstream, self.host, self.port)
        except OSError:
            self.transport.write(_BAD_GATEWAY)
            self.transport.close()
            return
        finally:
            self._connecting = False
        if self.transport.is_closing():
            assert upstream.transport is not None
            upstream.transport.close()
            return
        self.upstream = upstream
        assert upstream.transport is not None
        upstream.start()
        upstream.transport.write(wire)


class Upstream(asyncio.Protocol):
    """The worker connection of one client connection."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.client.close()

    def start(self) -> None:
        """A request is about to be sent on this connection."""


class PipeUpstream(Upstream):
    def data_received(self, data: bytes) -> None:
        self.client.write(data)


# Parser states of ReframeUpstream.
_HEAD, _BODY, _IDLE = range(3)


class ReframeUpstream(Upstream):
    def __init__(self, client: asyncio.Transport) -> None:
        super().__init__(client)
        self._state = _IDLE
        self._buf = b""
        self._sse = b""
        self._decoder = ChunkedDecoder()
        self._tokens = 0
        self._stop_reason = "end_turn"

    def start(self) -> None:
        self._state = _HEAD
        self._buf = self._sse = b""
        self._decoder = ChunkedDecoder()
        self._tokens = 0
        self._stop_reason = "end_turn"

    def data_received(self, data: bytes) -> None:
        out: list[bytes] = []  # the frames of this read, written as one chunk
        if self._state == _HEAD:
            buf = self._buf + data if self._buf else data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            head = buf[:end].lower()
            if head[9:12] != b"200" or b"\r\ntransfer-encoding: chunked" not in head:
                self._fail()
                return
            self.client.write(_REFRAME_HEAD)
            out.append(self._start_frames())
            self._state = _BODY
            self._buf = b""
            data = buf[end + 4 :]
        elif self._state != _BODY:  # _IDLE: bytes with no request outstanding
            self._fail()
            return
        try:
            payload = self._decoder.feed(data)  # the gateway's own decoder, as the gateway relays
        except ChunkedFramingError:
            self._fail()
            return
        if payload:
            self._sse += payload
            self._events(out)
        if self._decoder.done:
            self._finish(out)
        elif out:
            self.client.write(_chunk(b"".join(out)))

    def _events(self, out: list[bytes]) -> None:
        sse = self._sse
        start = 0
        while True:
            end = sse.find(b"\n\n", start)
            if end < 0:
                break
            event = sse[start:end]
            start = end + 2
            if not event.startswith(b"data:"):
                continue  # comments, event names: the sim sends neither
            data = event[5:].lstrip(b" ")
            if data == b"[DONE]":
                continue
            chunk = orjson.loads(data)
            choices = chunk.get("choices")
            if not choices:
                continue
            choice = choices[0]
            text = choice.get("delta", {}).get("content")
            if text:
                out.append(text_delta_frame(0, text))
                self._tokens += 1
            finish = choice.get("finish_reason")
            if finish:
                self._stop_reason = _STOP_REASONS.get(finish, "end_turn")
        self._sse = sse[start:]

    @staticmethod
    def _start_frames() -> bytes:
        return encode_events([
            {"type": "message_start", "message": {
                "id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": "floor",
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ])

    def _finish(self, out: list[bytes]) -> None:
        out.append(encode_events([
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": self._stop_reason, "stop_sequence": None},
             "usage": {"output_tokens": self._tokens}},
            {"type": "message_stop"},
        ]))
        self.client.write(_chunk(b"".join(out)) + _LAST_CHUNK)
        self._state = _IDLE
        self._buf = b""

    def _fail(self) -> None:
        if self._state == _HEAD:
            self.client.write(_BAD_GATEWAY)
        self.client.close()
        if self.transport is not None:
            self.transport.close()


async def serve(mode: str, upstream: str, host: str, port: int) -> None:
    parts = urlsplit(upstream)
    assert parts.hostname is not None and parts.port is not None, f"upstream needs host and port: {upstream}"
    uhost, uport = parts.hostname, parts.port
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(mode, uhost, uport), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()
    print(f"floor_proxy {mode} ({type(loop).__module__}) listening on http://{bound[0]}:{bound[1]}", flush=True)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("pipe", "reframe"), required=True)
    parser.add_argument("--upstream", required=True, help="the worker's base URL, http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's default loop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.run(serve(args.mode, args.upstream, args.host, args.port))
    else:
        asyncio.run(serve(args.mode, args.upstream, args.host, args.port))


if __name__ == "__main__":
    main()
