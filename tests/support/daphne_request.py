"""Daphne's own request object, parsed by daphne's protocol on a transport of the test's choice,
and the `send` daphne gives the application for it (unit tests of what writes to it directly)."""

from __future__ import annotations

import asyncio
from typing import Any

from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server
from twisted.internet.testing import StringTransport

REQUEST = b"POST /v1/messages HTTP/1.1\r\nhost: gateway\r\ncontent-length: 2\r\n\r\n{}"
START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


async def daphne_request(transport: Any = None, request: bytes = REQUEST) -> tuple[Any, WebRequest, Any, Server]:
    """A request parsed by daphne's own protocol on `transport` (a StringTransport if None):
    `send` as daphne gave it to the application, the request, the transport and the server."""
    captured: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not captured.done():
            captured.set_result(send)
        await asyncio.sleep(3600)  # the test answers through `send`

    server = Server(application=application, endpoints=["tcp:port=0:interface=127.0.0.1"], signal_handlers=False)  # never run
    server.connections = {}  # what Server.run() would have set up
    protocol = HTTPFactory(server).buildProtocol(("127.0.0.1", 1))
    transport = StringTransport() if transport is None else transport
    protocol.makeConnection(transport)
    protocol.dataReceived(request)
    send = await asyncio.wait_for(captured, 5)
    parsed = send.args[0]
    assert isinstance(parsed, WebRequest)
    return send, parsed, transport, server


def stop(server: Server) -> None:
    """Cancel the applications daphne started (the test's `application`)."""
    for details in server.connections.values():
        task = details.get("application_instance")
        if task is not None:
            task.cancel()
