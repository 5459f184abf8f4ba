"""An ASGI application's answer read in-process, from a Channels `ApplicationCommunicator`: the
status, headers and whole body, and the body's server-sent events parsed (for tests that drive a
consumer directly, without a socket)."""

from __future__ import annotations

from typing import Any

import orjson
from channels.testing import ApplicationCommunicator


async def read_response(communicator: ApplicationCommunicator) -> tuple[int, dict[bytes, bytes], bytes]:
    start = await communicator.receive_output(10)
    assert start["type"] == "http.response.start"
    body = b""
    while True:
        message = await communicator.receive_output(10)
        assert message["type"] == "http.response.body"
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return start["status"], dict(start["headers"]), body


def sse_events(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(frame.split(b"\ndata: ", 1)[1]) for frame in body.split(b"\n\n") if frame]
