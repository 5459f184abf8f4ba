"""A generation worker that misbehaves on cue: it answers every chat request with a 200, a fixed
list of raw SSE bytes, then either hangs (keeps the connection open, silent) or closes it.

tests/support/scripted.py's server in a thread of its own, so the gateway's own worker client and
transport talk to it exactly as to a real worker. It records whether the gateway hung up on it,
which is how a test sees that a broken stream's worker request was abandoned rather than left
open.

    with ScriptedWorker([chunk({"content": "Hi"}), b"data: 5\\n\\n"]) as worker:
        ...  # register worker.url as a generation endpoint and send a request
        worker.wait_for_hang_up()
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from tests.support.scripted import ScriptedServer, read_request, until_hang_up
from tests.support.waiting import poll

HEALTH_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n"


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
    """One well-formed OpenAI chat.completion.chunk frame."""
    body = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "model": "fake",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ScriptedWorker:
    def __init__(self, frames: list[bytes], *, then: Literal["hang", "close"] = "hang") -> None:
        self.frames = frames
        self.then = then
        self.chat_requests = 0
        self.hung_up = 0  # chat connections the gateway closed while this worker held them open
        self._server = ScriptedServer(self._serve)

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> ScriptedWorker:
        self._server.start_thread()
        return self

    def stop(self) -> None:
        self._server.stop_thread()

    def __enter__(self) -> ScriptedWorker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait_for_hang_up(self, count: int = 1, timeout: float = 10.0) -> None:
        what = f"the worker connections the gateway closed (of {count} awaited)"
        poll(lambda: self.hung_up, lambda closed: closed >= count, timeout=timeout, what=what)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        request = await read_request(reader)
        if request is None:
            return
        if request.method == "GET":
            writer.write(HEALTH_ANSWER)
            return
        self.chat_requests += 1
        writer.write(STREAM_HEAD + b"".join(self.frames))
        await writer.drain()
        if self.then == "hang":
            await until_hang_up(reader)
            self.hung_up += 1
