"""A streamed response's middle frames written to daphne's request in one call, not four.

Under daphne, a consumer's `send_body(frame, more_body=True)` goes through Channels'
`AsyncHttpConsumer.send_body` (a message dict), `AsyncConsumer.send`, daphne's
`Server.handle_reply` (a coroutine: is the connection still there?) and `WebRequest.handle_reply`
(which kind of message is it? log it at debug level) before it reaches
`twisted.web.http.Request.write`, which frames the bytes as an HTTP chunk and hands them to the
connection in three pieces. For a stream that relays one token per frame that is six Python
frames, a dict and two tuples per token, for checks whose answer cannot change in the middle of a
body. `body_writer(send)` returns a function that makes daphne's own checks (the request not
finished, the connection not gone, the response started) and then, once the head is out, does what
`Request.write` does (count the bytes, frame the chunk) in one write to the connection; the first
frame (`Request.write` itself: it writes the head), the last one (`more_body=False`: daphne
finishes the request and logs it) and every other message still go through `send`.

It finds daphne's request behind `send` (messages_api/server/daphne_request.py) and reads
daphne's and Twisted's request and server attributes listed in disagg_project/relied_on.py
(tests/unit/disagg_project/test_relied_on.py checks that they exist); tests/unit/messages_api/server/test_body_writer.py checks the
bytes against daphne's path. Any other server: None, and the consumer queues its middle frames
for `send` instead (messages_api/server/send_queue.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.web import http

from messages_api.server.daphne_request import daphne_request
from messages_api.server.direct_write import DirectWriteServer

BodyWriter = Callable[[bytes], None]


def body_writer(send: Any) -> BodyWriter | None:
    """The direct writer for the request `send` answers, or None when `send` is not daphne's."""
    request = daphne_request(send)
    if request is None:
        return None
    server: Any = request.server
    connections: dict[Any, dict[str, Any]] = server.connections
    # daphne keeps one entry per request from its connection to its end and marks it
    # "disconnected" in place: looked up once, not per token (a lookup hashes the request
    # in Python, `WebRequest.__hash__`).
    connection = connections.get(request)
    write: Callable[[Any, bytes], None] = http.Request.write

    def write_body(body: bytes) -> None:
        # daphne's Server.handle_reply: nothing for a connection it no longer serves.
        if connection is None or "disconnected" in connection:
            return
        # WebRequest.handle_reply: nothing for a finished request; a body needs a started response.
        if request.finished or request.channel is None:
            return
        if not request._response_started:
            raise ValueError("HTTP response has not yet been started but got http.response.body")
        if request.startedWriting and request.chunked and not request._disconnected and body:
            # What Request.write does once the head is out, in one piece: the chunk's framing
            # (twisted.web.http.toChunk) around the body, one write to the connection.
            request.sentLength += len(body)
            request.channel.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            return
        # The first frame (it writes the head), HTTP/1.0, the rare rest; the head and the frame
        # in one send (messages_api/server/direct_write.py).
        transport = request.channel.transport
        if not isinstance(transport, DirectWriteServer):
            write(request, body)
            return
        transport.hold()
        try:
            write(request, body)
        finally:
            transport.release()

    return write_body


__all__ = ["body_writer", "BodyWriter"]
