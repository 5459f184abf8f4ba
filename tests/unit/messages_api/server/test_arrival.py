"""The request's arrival as daphne stamped it, read through the `send` daphne gives the
application (messages_api.server.arrival), checked against daphne's own Server.create_application."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from daphne.server import Server

from messages_api.audit import AuditRecord
from messages_api.server.arrival import seconds_since_received


class ParsedRequest:
    """Stands in for daphne's WebRequest: what it carries once `process()` has run."""

    def __init__(self, request_start: float) -> None:
        self.request_start = request_start


async def send_daphne_gives(request: object) -> Any:
    captured: dict[str, Any] = {}

    async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
        captured["send"] = send

    server = Server(application=application, endpoints=["tcp:port=0:interface=127.0.0.1"], signal_handlers=False)  # never run
    server.connections = {}  # what Server.run() would have set up
    server.protocol_connected(request)
    server.create_application(request, {"type": "http"})
    await server.connections[request]["application_instance"]
    return captured["send"]


async def test_the_wait_counts_from_when_daphne_parsed_the_request() -> None:
    send = await send_daphne_gives(ParsedRequest(time.time() - 0.25))
    lag = seconds_since_received(send)
    assert 0.25 <= lag < 1.0
    record = AuditRecord()
    before = record.received_monotonic
    record.received_earlier(lag)
    assert before - record.received_monotonic == lag
    assert record.since_received_ms() >= 250


async def test_no_stamp_or_an_implausible_one_counts_as_now() -> None:
    assert seconds_since_received(await send_daphne_gives(object())) == 0.0
    assert seconds_since_received(await send_daphne_gives(ParsedRequest(time.time() - 3600))) == 0.0
    assert seconds_since_received(await send_daphne_gives(ParsedRequest(time.time() + 5))) == 0.0

    async def plain_send(message: dict[str, Any]) -> None: ...

    assert seconds_since_received(plain_send) == 0.0
    assert seconds_since_received(asyncio.Queue().put) == 0.0
