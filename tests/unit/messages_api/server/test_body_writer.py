"""messages_api/server/body_writer.py: a stream's middle frames written to daphne's request directly give
the bytes daphne's own path gives, and nothing once the client is gone. Run against daphne's real
Server, HTTP factory and request (on a Twisted test transport), so a daphne or Twisted upgrade that
changes what the writer relies on fails here."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from daphne.http_protocol import WebRequest
from daphne.server import Server
from twisted.python.failure import Failure
from twisted.web import http

from messages_api.server.body_writer import body_writer
from tests.support.daphne_request import START, daphne_request, stop

FRAMES = [b"event: ping\ndata: {}\n\n", b"event: a\ndata: {\"x\":1}\n\n", b"x" * 70_000]


def without_date(data: bytes) -> bytes:
    return re.sub(rb"(?im)^date: [^\r]*\r\n", b"", data)


async def test_middle_frames_give_the_bytes_daphnes_path_gives() -> None:
    send_a, _, transport_a, server_a = await daphne_request()
    send_b, _, transport_b, server_b = await daphne_request()
    try:
        await send_a(START)
        for frame in FRAMES:
            await send_a({"type": "http.response.body", "body": frame, "more_body": True})
        await send_a({"type": "http.response.body", "body": b"end", "more_body": False})

        await send_b(START)
        write = body_writer(send_b)
        assert write is not None
        for frame in FRAMES:
            write(frame)
        await send_b({"type": "http.response.body", "body": b"end", "more_body": False})

        daphnes, ours = transport_a.value(), transport_b.value()
        assert ours.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in ours.lower()
        assert ours.endswith(b"3\r\nend\r\n0\r\n\r\n")
        assert without_date(ours) == without_date(daphnes)
    finally:
        stop(server_a)
        stop(server_b)


@pytest.mark.parametrize("how", ["connection lost", "daphne's mark alone"])
async def test_nothing_is_written_once_the_client_is_gone(how: str) -> None:
    """The writer looks daphne's entry for the request up once, when it is made; daphne marks that
    same entry disconnected (and only drops it after), so the writer sees the mark."""
    send, request, transport, server = await daphne_request()
    try:
        await send(START)
        write = body_writer(send)
        assert write is not None
        write(b"first")
        sent = transport.value()
        if how == "connection lost":
            request.connectionLost(Failure(ConnectionError("gone")))  # daphne marks it disconnected
        else:
            server.protocol_disconnected(request)  # Twisted's state untouched
            assert request.channel is not None and not request.finished
        assert server.connections[request].get("disconnected")
        write(b"second")
        assert transport.value() == sent
    finally:
        stop(server)


async def test_nothing_is_written_once_the_response_finished() -> None:
    send, request, transport, server = await daphne_request()
    try:
        await send(START)
        write = body_writer(send)
        assert write is not None
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        sent = transport.value()
        write(b"late")  # daphne ignores a reply to a finished request; so does the writer
        assert transport.value() == sent
    finally:
        stop(server)


async def test_a_body_before_the_response_started_is_refused_as_daphne_refuses_it() -> None:
    send, _, _, server = await daphne_request()
    try:
        write = body_writer(send)
        assert write is not None
        with pytest.raises(ValueError, match="not yet been started"):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        with pytest.raises(ValueError, match="not yet been started"):
            write(b"x")
    finally:
        stop(server)


async def test_any_other_send_has_no_writer() -> None:
    async def plain_send(message: dict[str, Any]) -> None: ...

    assert body_writer(plain_send) is None
    assert body_writer(asyncio.Queue().put) is None


def test_the_writer_repeats_daphnes_own_checks() -> None:
    # `send` is daphne's Server.handle_reply bound to the request (checked above with a real one);
    # the checks the writer repeats are daphne's own, on these names. (That every name still
    # exists: tests/unit/disagg_project/test_relied_on.py.)
    assert "connections" in Server.handle_reply.__code__.co_names
    assert "handle_reply" in vars(Server)
    for name in ("finished", "channel", "_response_started"):
        assert name in WebRequest.handle_reply.__code__.co_names, name
    # WebRequest writes a body with exactly the call the writer makes.
    assert "write" in WebRequest.handle_reply.__code__.co_names
    assert "Request" in WebRequest.handle_reply.__code__.co_names
    # ... and, once the head is out, does what Request.write does with them (the bytes are
    # compared with daphne's path above).
    names = http.Request.write.__code__.co_names
    assert {"toChunk", "writeSequence", "sentLength", "chunked", "startedWriting", "_disconnected", "finished"} <= set(names)

