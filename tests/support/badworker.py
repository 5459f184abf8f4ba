"""A misbehaving worker: a raw-TCP HTTP/1.1 server that speaks just enough of TensorRT-LLM's
disaggregated protocol to be registered as a pool's context and generation endpoint, and breaks
the protocol in the ways a real framework would refuse to (wrong-shape JSON, trickled bytes,
lines without end, 200,000 headers, leaky error bodies, dropped connections, silence).

The prompt chooses the misbehaviour: `[bad mode=NAME]` (or `[bad mode=NAME tag=T]`, see
`marker`) in the last user message (the sim's
`[sim ...]` directives still mean nothing here). Without a marker it answers like a healthy
worker (a context handoff, then a short text stream), so the same process also serves normal
requests. `python -m tests.support.badworker --port 0` prints `badworker listening on HOST:PORT`;
`start_badworker()` runs one as a child process for tests and benchmarks.

`GET /bad/stats` answers `{"active": open connections, "received": chat requests, "modes": {...}}`
so a test can wait for the gateway to have closed every connection it opened (no leak), and
`POST /bad/reset` zeroes the counters. `GET /health` answers 200.

Why not tests/support/scripted.py's server, which the other scripted workers use: this one is a
process of its own that bench/soak.py drives for many minutes, on a host and port it is given,
with a backlog of 1,024 and heads of up to 1 MiB. The scripted server keeps every connection's
writer for the test to look at; here that would grow for as long as the soak runs, so this server
keeps no per-connection state. Requests are read with the scripted server's `read_request`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.scripted import read_request
from tests.support.waiting import poll
from workers.sim.process import stop_process

PROJECT_ROOT = Path(__file__).resolve().parents[2]
_MARKER = re.compile(r"\[bad mode=([a-z_0-9]+)(?: tag=([A-Za-z0-9_-]+))?\]")
_LISTENING = "badworker listening on "

# What a misbehaving engine leaks in an error body: none of it may reach a client.
LEAKY_ERROR_TEXT = (
    "Traceback (most recent call last):\n"
    '  File "/opt/tensorrt_llm/serve/openai_server.py", line 412, in openai_chat\n'
    "    await self.executor.generate(request)\n"
    "RuntimeError: KV transfer to 10.20.30.40:8001 failed (api_key=sk-internal-123)"
)
# Fragments that must never appear in anything the gateway sends a client.
# (`api_key=<redacted>` is fine: the label is not the secret.)
LEAK_MARKERS = ("10.20.30.40", ":8001", "/opt/tensorrt_llm", "Traceback", "sk-internal-123", "openai_server.py")

# Modes for which the context phase misbehaves; every other mode misbehaves in generation
# (the context phase then answers a valid handoff).
CONTEXT_MODES = frozenset(
    {
        "context_hang",
        "context_trickle_headers",
        "context_trickle_json",
        "context_many_headers",
        "context_error_body",
        "context_oops",
        "context_drop",
        "context_huge_json",
        "context_not_json",
    }
)

# Chunks of valid JSON but the wrong shape, sent after a healthy start of the stream.
WRONG_SHAPE_CHUNKS: dict[str, Any] = {
    "choices_null_item": {"choices": [None]},
    "array_chunk": [1, 2, 3],
    "choices_string": {"choices": "abc"},
    "number_chunk": 5,
    "usage_number": {"choices": [], "usage": 5},
    "usage_tokens_string": {"choices": [], "usage": {"prompt_tokens": "many", "completion_tokens": 1, "total_tokens": 1}},
    "tool_args_object": {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                "finish_reason": None,
            }
        ]
    },
    "delta_null": {"choices": [{"index": 0, "delta": None, "finish_reason": None}]},
    "content_number": {"choices": [{"index": 0, "delta": {"content": 42}, "finish_reason": None}]},
    "content_object": {"choices": [{"index": 0, "delta": {"content": {"text": "x"}}, "finish_reason": None}]},
}

GENERATION_MODES = frozenset(
    {
        *WRONG_SHAPE_CHUNKS,
        "generation_hang",
        "trickle_headers",
        "trickle_sse",
        "huge_line",
        "many_headers",
        "error_body",
        "error_frame",
        "drop_mid_stream",
        "idle_mid_stream",
        "not_sse",
    }
)
MODES = CONTEXT_MODES | GENERATION_MODES

TRICKLE_INTERVAL_S = 0.1  # one byte every 100 ms: far below any idle timeout, never a whole chunk
STARTED_PAUSE_S = 0.6  # after the healthy start, before the fault: the client has its 200 by then


def marker_of(body: Any) -> tuple[str | None, str]:
    """The `[bad mode=NAME tag=T]` of the request's last user message: (mode or None, tag or "")."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return None, ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            match = _MARKER.search(text)
            return (match.group(1), match.group(2) or "") if match else (None, "")
    return None, ""


def marker(mode: str, tag: str = "") -> str:
    """The prompt text that selects `mode` (and labels the request's connections with `tag`)."""
    return f"[bad mode={mode} tag={tag}]" if tag else f"[bad mode={mode}]"


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    """A response head; always `connection: close`: one request per connection, so a gateway
    never pools a connection this server will not read from again."""
    if not any(name == "connection" for name, _ in headers):
        headers = [*headers, ("connection", "close")]
    reason = {200: "OK", 500: "Internal Server Error"}.get(status, "Status")
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json_response(status: int, payload: Any) -> bytes:
    body = json.dumps(payload).encode()
    return _head(status, [("content-type", "application/json"), ("content-length", str(len(body))), ("connection", "close")]) + body


def _sse_head() -> bytes:
    # No content-length and no chunked encoding: the body ends when the connection closes, which
    # lets every mode write raw bytes.
    return _head(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache"), ("connection", "close")])


def _chunk(delta: dict[str, Any], finish: str | None = None, completion_tokens: int = 1) -> bytes:
    payload = {
        "id": "chatcmpl-bad",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "bad-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        "usage": {"prompt_tokens": 12, "completion_tokens": completion_tokens, "total_tokens": 12 + completion_tokens},
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def context_answer(body: dict[str, Any]) -> dict[str, Any]:
    """A valid `context_only` answer: the handoff the generation request will carry back."""
    params = body.get("disaggregated_params") or {}
    request_id = params.get("disagg_request_id") or 1
    return {
        "id": "chatcmpl-ctx",
        "object": "chat.completion",
        "model": "bad-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ""},
                "finish_reason": "length",
                "disaggregated_params": {
                    "request_type": "context_only", "ctx_request_id": request_id, "disagg_request_id": request_id, "first_gen_tokens": [1],
                },
            }
        ],
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }


@dataclass
class Stats:
    active: int = 0
    received: int = 0
    modes: Counter[str] = field(default_factory=Counter)
    # Open chat connections per tag: a test waits for its own tag to reach 0 even while earlier
    # tests' requests still hold connections.
    active_tags: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> dict[str, Any]:
        tags = {tag: n for tag, n in self.active_tags.items() if n}
        return {"active": self.active, "received": self.received, "modes": dict(self.modes), "active_tags": tags}


class BadWorker:
    """The server: one coroutine per connection, one request per connection."""

    def __init__(self) -> None:
        self.stats = Stats()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader)
            if request is not None:
                await self._route(request.method, request.path, request.body, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the gateway hung up: that is what several modes wait for
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if path == "/bad/stats":
            writer.write(_json_response(200, self.stats.as_json()))
        elif path == "/bad/reset" and method == "POST":
            self.stats = Stats(active=self.stats.active, active_tags=self.stats.active_tags)
            writer.write(_json_response(200, {"ok": True}))
        elif path == "/health":
            writer.write(_json_response(200, {"status": "ok"}))
        elif path == "/server_info":
            # What a TensorRT-LLM context server reports for generation-first requests.
            writer.write(_json_response(200, {"server_info": {"disaggregated_params": {"ctx_info_endpoint": ["tcp://127.0.0.1:1"]}}}))
        elif path == "/v1/chat/completions" and method == "POST":
            request = json.loads(body or b"{}")
            _, tag = marker_of(request)
            stats = self.stats
            stats.active += 1
            stats.active_tags[tag] += 1
            try:
                await self._chat(request, reader, writer)
            finally:
                stats.active -= 1
                stats.active_tags[tag] -= 1
            return
        else:
            writer.write(_json_response(404, {"error": {"message": "not found"}}))
        await writer.drain()

    async def _chat(self, body: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.received += 1
        mode = marker_of(body)[0] or "healthy"
        self.stats.modes[mode] += 1
        params = body.get("disaggregated_params") or {}
        if params.get("request_type") == "context_only":
            behave = _CONTEXT_BEHAVIOUR.get(mode, _context_ok)
        else:
            behave = _GENERATION_BEHAVIOUR.get(mode, _generation_ok)
        # Whatever the mode is doing (hanging, trickling, writing 100 MiB), the gateway hanging up
        # ends it: that is how `active` falls back to 0 and a test sees the connection released.
        behaving = asyncio.ensure_future(behave(body, writer, mode))
        hung_up = asyncio.ensure_future(reader.read())
        try:
            await asyncio.wait({behaving, hung_up}, return_when=asyncio.FIRST_COMPLETED)
            if behaving.done():
                behaving.result()  # done writing: every answer says `connection: close`
        finally:
            for task in (behaving, hung_up):
                task.cancel()
            await asyncio.gather(behaving, hung_up, return_exceptions=True)


Behaviour = Callable[[dict[str, Any], asyncio.StreamWriter, str], Awaitable[None]]


async def _forever() -> None:
    """Never answer more; the connection stays open until the gateway closes it."""
    await asyncio.Event().wait()


async def _trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """`data`, one byte every TRICKLE_INTERVAL_S, over and over until the peer hangs up."""
    while True:
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(TRICKLE_INTERVAL_S)


async def _many_headers(writer: asyncio.StreamWriter, count: int = 200_000) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
    batch = 2000
    for start in range(0, count, batch):
        writer.write(b"".join(b"x-filler-%d: %s\r\n" % (i, b"v" * 380) for i in range(start, start + batch)))
        await writer.drain()
    writer.write(b"\r\n" + _chunk({"role": "assistant", "content": "hi"}, "stop") + b"data: [DONE]\n\n")
    await writer.drain()


async def _context_ok(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    writer.write(_json_response(200, context_answer(body)))
    await writer.drain()


async def _generation_ok(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    writer.write(_sse_head() + _chunk({"role": "assistant", "content": ""}, completion_tokens=0))
    for n, word in enumerate(("All", " is", " well"), start=1):
        writer.write(_chunk({"content": word}, completion_tokens=n))
    writer.write(_chunk({}, "stop", completion_tokens=3) + b"data: [DONE]\n\n")
    await writer.drain()


async def _healthy_start(writer: asyncio.StreamWriter) -> None:
    """A stream that starts well: role chunk and two tokens, then a pause so the gateway has sent
    its 200 and a first content event before the fault."""
    writer.write(_sse_head() + _chunk({"role": "assistant", "content": ""}, completion_tokens=0))
    writer.write(_chunk({"content": "Hello"}, completion_tokens=1) + _chunk({"content": " there"}, completion_tokens=2))
    await writer.drain()
    await asyncio.sleep(STARTED_PAUSE_S)


async def _wrong_shape(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _healthy_start(writer)
    writer.write(b"data: " + json.dumps(WRONG_SHAPE_CHUNKS[mode]).encode() + b"\n\n")
    # Then a clean finish: a gateway that ignored the broken chunk would end with message_stop.
    writer.write(_chunk({"content": " more"}, completion_tokens=3) + _chunk({}, "stop", completion_tokens=3) + b"data: [DONE]\n\n")
    await writer.drain()
    await _forever()  # never close: only the gateway can end this


async def _hang(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _forever()


async def _trickle_headers(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _trickle(writer, b"HTTP/1.1 200 OK\r\n" + b"x-slow: " + b"a" * 10_000)


async def _trickle_json(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    answer = json.dumps(context_answer(body)).encode()
    writer.write(_head(200, [("content-type", "application/json"), ("content-length", str(len(answer) + 100_000)), ("connection", "close")]))
    await _trickle(writer, answer[:-1] + b" " * 100_000)


async def _trickle_sse(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _healthy_start(writer)
    await _trickle(writer, b'data: {"choices":[{"index":0,"delta":{"content":"' + b"z" * 100_000)


async def _huge_line(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _healthy_start(writer)
    writer.write(b'data: {"choices":[{"index":0,"delta":{"content":"')
    block = b"y" * 65536
    for _ in range(100 * 1024 * 1024 // len(block)):  # 100 MiB without a newline
        writer.write(block)
        await writer.drain()
    await _forever()


async def _generation_many_headers(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _many_headers(writer)
    await _forever()


async def _context_many_headers(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    answer = json.dumps(context_answer(body)).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    for start in range(0, 200_000, 2000):
        writer.write(b"".join(b"x-filler-%d: %s\r\n" % (i, b"v" * 380) for i in range(start, start + 2000)))
        await writer.drain()
    writer.write(b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(answer) + answer)
    await writer.drain()
    await _forever()


async def _error_body(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    payload = {"object": "error", "message": LEAKY_ERROR_TEXT, "type": "InternalServerError", "code": 500}
    writer.write(_json_response(500, {"error": payload, **payload}))
    await writer.drain()


async def _error_frame(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _healthy_start(writer)
    writer.write(b"data: " + json.dumps({"error": {"message": LEAKY_ERROR_TEXT, "type": "InternalServerError", "code": 500}}).encode() + b"\n\n")
    await writer.drain()
    await _forever()


async def _context_oops(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    writer.write(_json_response(200, {"id": "x", "message": "oops", "choices": [{"index": 0, "message": "oops", "finish_reason": "stop"}]}))
    await writer.drain()


async def _context_huge_json(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    # A valid handoff, 64 MiB long: only a size limit tells it from a good answer. The head goes
    # out at once and the filler a MiB at a time, never built whole: building 64 MiB (and copies of
    # it) before the head took over the gateway's 1 s context deadline on a loaded machine, which
    # then answered a timeout instead of the size refusal this case is about.
    opening = json.dumps(context_answer(body)).encode()[:-1] + b', "x_filler": "'
    slice_, slices, closing = b"x" * (1 << 20), 64, b'"}'
    length = len(opening) + len(slice_) * slices + len(closing)
    writer.write(_head(200, [("content-type", "application/json"), ("content-length", str(length))]) + opening)
    await writer.drain()
    for _ in range(slices):
        writer.write(slice_)
        await writer.drain()
    writer.write(closing)
    await writer.drain()
    await _forever()


async def _context_not_json(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    text = f"<html><pre>{LEAKY_ERROR_TEXT}</pre></html>".encode()
    writer.write(_head(200, [("content-type", "application/json"), ("content-length", str(len(text)))]) + text)
    await writer.drain()


async def _drop(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    writer.transport.abort()  # RST, no answer


async def _drop_mid_stream(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _healthy_start(writer)
    writer.write(b'data: {"choices":[{"index":0,"delta":{"content":"cut')
    await writer.drain()
    writer.transport.abort()


async def _idle_mid_stream(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _healthy_start(writer)
    await _forever()


async def _not_sse(body: dict[str, Any], writer: asyncio.StreamWriter, mode: str) -> None:
    await _healthy_start(writer)
    writer.write(b"data: {not json at all " + LEAKY_ERROR_TEXT.encode().replace(b"\n", b" ") + b"\n\n")
    await writer.drain()
    await _forever()


_CONTEXT_BEHAVIOUR: dict[str, Behaviour] = {
    "context_hang": _hang,
    "context_trickle_headers": _trickle_headers,
    "context_trickle_json": _trickle_json,
    "context_many_headers": _context_many_headers,
    "context_error_body": _error_body,
    "context_oops": _context_oops,
    "context_drop": _drop,
    "context_huge_json": _context_huge_json,
    "context_not_json": _context_not_json,
}
_GENERATION_BEHAVIOUR: dict[str, Behaviour] = {
    **{name: _wrong_shape for name in WRONG_SHAPE_CHUNKS},
    "generation_hang": _hang,
    "trickle_headers": _trickle_headers,
    "trickle_sse": _trickle_sse,
    "huge_line": _huge_line,
    "many_headers": _generation_many_headers,
    "error_body": _error_body,
    "error_frame": _error_frame,
    "drop_mid_stream": _drop_mid_stream,
    "idle_mid_stream": _idle_mid_stream,
    "not_sse": _not_sse,
}
assert set(_CONTEXT_BEHAVIOUR) == CONTEXT_MODES and set(_GENERATION_BEHAVIOUR) == GENERATION_MODES


async def serve(host: str, port: int) -> None:
    worker = BadWorker()
    server = await asyncio.start_server(worker.handle, host, port, limit=1 << 20, backlog=1024)
    bound = server.sockets[0].getsockname()
    print(f"{_LISTENING}{bound[0]}:{bound[1]}", flush=True)
    async with server:
        await server.serve_forever()


# --- as a child process ----------------------------------------------------------------------------

_running: set[RunningBadWorker] = set()


@dataclass(eq=False)
class RunningBadWorker:
    """A bad worker process started by `start_badworker`."""

    host: str
    port: int
    process: subprocess.Popen[str] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(self.url + "/bad/stats", timeout=5.0, trust_env=False).json()
        return result

    def reset(self) -> None:
        httpx.post(self.url + "/bad/reset", timeout=5.0, trust_env=False).raise_for_status()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        return poll(self.stats, predicate, timeout=timeout, what="the bad worker's stats")

    def stop(self) -> None:
        _running.discard(self)
        stop_process(self.process, grace=5.0)


def start_badworker(host: str = "127.0.0.1", port: int = 0) -> RunningBadWorker:
    """Start `python -m tests.support.badworker` on a free port and wait until it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.badworker", "--host", host, "--port", str(port)],
        cwd=PROJECT_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        with process.stdout:
            for line in process.stdout:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        line = lines.get(timeout=20)
    except queue.Empty:
        line = None
    if line is None or _LISTENING not in line:
        process.kill()
        process.wait()
        raise RuntimeError(f"badworker did not start: {line!r}")
    worker = RunningBadWorker(host, int(line.strip().rsplit(":", 1)[1]), process)
    _running.add(worker)
    return worker


@atexit.register
def _stop_all() -> None:
    for worker in list(_running):
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
