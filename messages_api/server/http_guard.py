"""The HTTP intake guard: what a client sends is bounded while daphne's parser reads it.

Daphne serves HTTP/1.1 through Twisted's parser, which writes a request's whole body to a file
before daphne looks at the request; daphne then queues the body to the application in 8 KiB
messages, all at once. The consumer's own 413 therefore came after the memory was spent: four
parallel 400 MB uploads without an API key took a gateway from 93 to 1,723 MiB. Twisted's own
rejections are bare (an empty `400`; a header line over 16 KiB: the connection closed without an
answer), and its idle timer restarts on every byte, so a client sending one byte a second holds a
connection for ever.

This module plugs into the parser where each of these is decided, per connection, before any
application runs:

- a declared `Content-Length` over MESSAGES_MAX_BODY_BYTES: 413 once the headers are in, before
  a byte of the body is read (and instead of `100 Continue`); on a path that is not an API route
  (Django's pages, an unknown path) the limit is Django's own DATA_UPLOAD_MAX_MEMORY_SIZE if
  lower (2.5 MiB by default): no anonymous request gets a large body read anywhere;
- a chunked body: counted as it is decoded, cut with the same 413 when it passes the limit;
- the request line, headers and body must arrive within MESSAGES_BODY_READ_TIMEOUT_S of the
  request's first byte (a connection that sends nothing is left to the idle timeout below, which
  closes it silently: an unasked-for answer on an idle kept-alive connection would be read by
  the client as the answer to its next request);
- a malformed request line, header or chunked framing: 400 instead of Twisted's empty one;
- a line over Twisted's 16 KiB, a header section over 16 KiB or more than 500 headers: 431;
- daphne's own HTML error pages (bytes it cannot decode in the path, ...): the same envelope;
- what the headers alone decide (messages_api/server/header_gate.py): the API key of every API
  route (401 before the body is read; a key the cache does not know is looked up while the
  connection is not read), who may read `/metrics`, and a Cookie header over
  GATEWAY_MAX_COOKIE_BYTES (431) or with a backslash (400). A client's `Daphne-Root-Path` header
  is removed: it would move the path daphne routes on away from the one checked.

And per connection, from its accept (`GuardedHTTPFactory`):

- at most GATEWAY_MAX_CONNECTIONS_PER_ADDRESS open connections per client address (the socket's
  peer): past it, a connection is closed as soon as it is accepted, before any protocol exists;
- a connection with no request in progress is closed after GATEWAY_IDLE_CONNECTION_TIMEOUT_S of
  silence (Twisted's idle timer, which restarts on every byte: a request in progress is bounded
  by the read deadline above instead).

Statuses and types. Each answer is Anthropic's envelope
(`{"type":"error","error":{"type":..,"message":..},"request_id":"req_.."}`, JSON, `request-id`
header). A body over the limit is Anthropic's documented 413 `request_too_large`. A header
section too large has no Anthropic status; 431 (RFC 6585) is the one HTTP defines for it, and
`request_too_large` is Anthropic's type for a request over a byte limit; the SDKs raise their
generic status error for it and do not retry, as for 413. A request not received in time is
HTTP's 408 with Anthropic's `timeout_error`; the SDKs retry 408 (with 409, 429 and 5xx),
which is right for a slow link. Malformed HTTP is 400 `invalid_request_error`.

How a refusal ends: the answer is written with `connection: close`, the write side is shut (a FIN
after the answer) and whatever the client still sends is read and dropped, for at most
`LINGER_S`; then the connection is aborted. Closing at once with unread input would make the
kernel send a reset, which can destroy the answer before a client that is still writing its body
reads it.

Installation: `install()` makes daphne's `Server.run()` build its HTTP factory from
`GuardedHTTPFactory` (it instantiates the module global `daphne.server.HTTPFactory`);
`disagg_project/asgi.py` calls it when loaded under daphne, whose command line imports the
application before it runs the server. Every daphne and Twisted internal used here is listed in
disagg_project/relied_on.py (an override of a method that was renamed would silently do nothing);
tests/unit/test_relied_on.py fails when an upgrade changes one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from http import HTTPStatus
from types import ModuleType
from typing import Any

import orjson
from daphne.http_protocol import HTTPFactory, WebRequest
from django.conf import settings
from prometheus_client import Counter
from twisted.internet.base import DelayedCall
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol

from messages_api.audit import AuditRecord, RateSampler, new_request_id, sample_anonymous
from messages_api.auth import Principal
from messages_api.errors import error_body, error_type_for_status
from messages_api.models import RequestStatus
from messages_api.request_context import loggable
from messages_api.server import header_gate
from messages_api.server.direct_write import DirectWriteServer

__all__ = ["GuardedChannel", "GuardedHTTPFactory", "GuardedRequest", "install", "refusal_bytes"]

logger = logging.getLogger(__name__)

# How long a refused connection keeps reading (and dropping) what the client still sends, so the
# answer is not destroyed by a reset while the client is busy writing. Loopback drains a 400 MB
# upload in well under this; a client on a slow link that never reads while writing loses the
# answer either way.
LINGER_S = 2.0

# Anthropic's type for a request over a byte limit, also for the header section's 431.
TOO_LARGE = "request_too_large"

refused = Counter(
    "gateway_http_refused",
    "Requests refused by the HTTP intake guard before any application saw them, by status.",
    ["status"],
)
connections_refused = Counter(
    "gateway_connections_refused",
    "Connections closed at accept: their client address already had GATEWAY_MAX_CONNECTIONS_PER_ADDRESS open.",
)
_cap_log_sampler: RateSampler | None = None


def refusal_bytes(
    status: int, message: str, error_type: str | None = None, request_id: str | None = None, retry_after: int | None = None
) -> bytes:
    """A complete HTTP/1.1 answer in Anthropic's envelope that closes the connection."""
    request_id = request_id or new_request_id()
    body = orjson.dumps(error_body(error_type or error_type_for_status(status), message, request_id))
    head = (
        f"HTTP/1.1 {status} {_phrase(status)}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"request-id: {request_id}\r\n"
        + (f"retry-after: {retry_after}\r\n" if retry_after is not None else "")
        + "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedChannel(HTTPChannel):
    """Twisted's HTTP/1.1 channel with the limits above; everything after a request's body has
    arrived (daphne's processing, the response, disconnect detection) is Twisted's own."""

    # HTTPChannel's methods carry no annotations, so each call to one is an untyped call to mypy.

    _refused: int | None = None  # the status of the refusal sent, once one is
    # What `callLater` returns: every reactor's (and the test clock's) `callLater` makes a
    # DelayedCall. Typed as the class, not the IDelayedCall interface: zope.interface declares
    # methods without `self`, which mypy (without the zope plugin) cannot call on an instance.
    _intake_deadline: DelayedCall | None = None
    _linger: DelayedCall | None = None
    # While the request's API key is looked up: the lookup, and whether the request's content
    # (none: a GET) was complete meanwhile. The connection is not read in the meantime.
    _key_lookup: asyncio.Future[Principal | None] | None = None
    _content_waits = False
    # The client address this connection counts against (GuardedHTTPFactory's cap), if any.
    _counted: tuple[GuardedHTTPFactory, str] | None = None

    def dataReceived(self, data: bytes) -> None:
        if self._refused is not None:
            return  # lingering after a refusal: read and drop
        if self._intake_deadline is None and not self._handlingRequest:
            # The first byte of a request (the connection's first, or the next on a kept-alive
            # connection) starts its clock; Twisted's idle timer restarts on every byte.
            timeout = settings.MESSAGES_BODY_READ_TIMEOUT_S
            self._intake_deadline = self.callLater(timeout, self._intake_timed_out)  # type: ignore[no-untyped-call]  # untyped Twisted
        super().dataReceived(data)  # type: ignore[no-untyped-call]  # untyped Twisted
        if self._key_lookup is not None:
            # Held (the parser keeps what came in its buffer): the transport may have been resumed
            # by Twisted's write-side flow control; no more than this read is taken meanwhile.
            self._networkProducer.pauseProducing()  # type: ignore[misc]  # a zope interface method (see refuse)

    def allHeadersReceived(self) -> None:
        request = self.requests[-1]
        limit = header_gate.body_limit(self._target())
        if isinstance(request, GuardedRequest):
            request.body_limit = limit  # for a chunked body, counted as it is decoded
        # `length` is the declared Content-Length (None when chunked), known before the body.
        if self.length is not None and self.length > limit:
            self.refuse(413, body_too_large_message(limit), TOO_LARGE)
            return  # not Twisted's: no `100 Continue`, no body file
        headers = request.requestHeaders
        # Daphne takes the scope's root path from this header, which would let a client move the
        # path the router matches away from the one checked below; no deployment of ours sets it.
        headers.removeHeader(b"daphne-root-path")
        peer = self.getPeer() if self.transport is not None else None  # type: ignore[no-untyped-call]  # untyped Twisted
        verdict = header_gate.check(self._target(), headers, getattr(peer, "host", None))
        if isinstance(verdict, header_gate.Refusal):
            self._refuse_for(verdict)
            return
        if isinstance(verdict, header_gate.KeyLookup):
            self._hold(verdict.future)
            return
        super().allHeadersReceived()  # type: ignore[no-untyped-call]  # untyped Twisted

    def allContentReceived(self) -> None:
        if self._refused is not None:
            return  # a refused request never reaches daphne
        if self._key_lookup is not None:
            self._content_waits = True  # a request without a body, complete while its key is looked up
            return
        self._cancel(self._intake_deadline)
        self._intake_deadline = None
        super().allContentReceived()  # type: ignore[no-untyped-call]  # untyped Twisted

    def _target(self) -> bytes:
        """The request line's target (Twisted keeps it until the request's content is complete)."""
        # HTTPChannel's source reuses the name it stores from for a Request: mypy infers that type.
        target: bytes = self._path  # type: ignore[assignment]
        return target

    # --- the key's lookup -----------------------------------------------------------------------

    def _hold(self, lookup: asyncio.Future[Principal | None]) -> None:
        """Stop reading and parsing this connection until `lookup` says whether the key is valid:
        what has arrived of the body stays in the parser's buffer, the rest in the socket."""
        self._key_lookup = lookup
        self.paused = True  # LineReceiver's loop stops at this flag
        self._networkProducer.pauseProducing()  # type: ignore[misc]  # a zope interface method (see refuse)
        lookup.add_done_callback(self._key_looked_up)

    def _key_looked_up(self, lookup: asyncio.Future[Principal | None]) -> None:
        if self._key_lookup is not lookup or self._refused is not None or self.transport is None:
            return  # the connection ended, or the request was refused (its read deadline) meanwhile
        self._key_lookup = None
        refusal = header_gate.lookup_refusal(lookup)
        if refusal is not None:
            self._refuse_for(refusal)
            return
        super().allHeadersReceived()  # type: ignore[no-untyped-call]  # the `100 Continue`, the body file
        if self._content_waits:
            self._content_waits = False
            self.allContentReceived()
        self.paused = False
        if not self._waitingForTransport:
            self._networkProducer.resumeProducing()  # type: ignore[misc]  # a zope interface method (see refuse)
        self.dataReceived(b"")  # parse what arrived meanwhile

    def _refuse_for(self, refusal: header_gate.Refusal) -> None:
        if not refusal.unauthenticated:
            self.refuse(refusal.status, refusal.message, refusal.error_type, retry_after=refusal.retry_after)
            return
        # As the consumers do for a request without a valid key: counted always, its audit row
        # (and access log line) only sampled (AUDIT_UNAUTHENTICATED_SAMPLE_PER_S).
        path = header_gate.scope_path(self._target()) or "?"
        record = AuditRecord(route=f"{self._command.decode('ascii', 'replace')} {path}")
        detail = sample_anonymous(refusal.message)
        record.end(
            RequestStatus.REJECTED,
            http_status=refusal.status,
            error_type=refusal.error_type,
            error_message=detail or refusal.message,
            persist=detail is not None,
        )
        self.refuse(
            refusal.status, refusal.message, refusal.error_type, request_id=record.request_id, log=False, retry_after=refusal.retry_after
        )

    def lineLengthExceeded(self, line: bytes) -> None:
        self.refuse(431, f"A request line or header is longer than the limit of {self.MAX_LENGTH} bytes", TOO_LARGE)

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's one answer for every parse failure; its counters say which limit it was.
        if self._receivedHeaderSize > self.totalHeadersSize:
            self.refuse(431, f"The request line and headers are larger than the limit of {self.totalHeadersSize} bytes", TOO_LARGE)
        elif self._receivedHeaderCount > self.maxHeaders:
            self.refuse(431, f"The request has more than the limit of {self.maxHeaders} headers", TOO_LARGE)
        elif not self.line_mode:
            self.refuse(400, "The request body's chunked encoding is malformed")
        else:
            self.refuse(400, "The request line or headers are malformed")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel(self._intake_deadline)
        self._cancel(self._linger)
        self._key_lookup = None
        counted, self._counted = self._counted, None
        if counted is not None:
            counted[0].connection_closed(counted[1])
        super().connectionLost(reason)  # type: ignore[no-untyped-call]  # untyped Twisted

    # --- the refusal ----------------------------------------------------------------------------

    def refuse(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        *,
        request_id: str | None = None,
        log: bool = True,
        retry_after: int | None = None,
    ) -> None:
        """Answer `status` in Anthropic's envelope, stop parsing, and close (lingering)."""
        transport = self.transport
        if self._refused is not None or transport is None:
            return
        self._refused = status
        self._cancel(self._intake_deadline)
        self._intake_deadline = None
        # Twisted's idle timer: the linger decides from now on.
        self.setTimeout(None)  # type: ignore[no-untyped-call]  # untyped Twisted
        self._buffer = b""  # input the line parser has not reached is never parsed now
        self.persistent = False
        if self._key_lookup is not None:
            # Held for a key lookup: read again, so the linger drains what the client still sends.
            self._key_lookup = None
            self._networkProducer.resumeProducing()  # type: ignore[misc]  # a zope interface method (below)
        refused.labels(status=str(status)).inc()
        if log:
            logger.info("refused a request from %s with %s: %s", _peer(transport), status, loggable(message))
        # ITransport.write is a zope.interface method, declared without `self`: mypy (without the
        # zope plugin) counts one argument too many.
        transport.write(refusal_bytes(status, message, error_type, request_id, retry_after))  # type: ignore[call-arg,misc]
        lose_write = getattr(transport, "loseWriteConnection", None)
        if lose_write is None:
            self.loseConnection()  # type: ignore[no-untyped-call]  # untyped Twisted
            return
        lose_write()
        self._linger = self.callLater(LINGER_S, self._end_linger)  # type: ignore[no-untyped-call]  # untyped Twisted

    def _intake_timed_out(self) -> None:
        self._intake_deadline = None
        if not self._handlingRequest:
            seconds = settings.MESSAGES_BODY_READ_TIMEOUT_S
            self.refuse(408, f"The request was not received within {seconds:g} seconds", "timeout_error")

    def _end_linger(self) -> None:
        self._linger = None
        if self.transport is not None:
            self.transport.abortConnection()

    @staticmethod
    def _cancel(call: DelayedCall | None) -> None:
        if call is not None and call.active():
            call.cancel()


class GuardedRequest(WebRequest):  # type: ignore[misc]  # daphne is untyped: WebRequest is Any
    """Daphne's request, counting the body as it is decoded and answering in Anthropic's envelope."""

    def __init__(self, channel: HTTPChannel, *args: Any, **kwargs: Any) -> None:
        # Twisted would parse a POSTed form body into `args` (all of it, in memory); daphne never
        # reads `args`.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(channel, *args, **kwargs)
        self.body_bytes = 0
        self.body_limit: int = settings.MESSAGES_MAX_BODY_BYTES  # the channel sets this request's own

    def handle_reply(self, message: dict[str, Any]) -> None:
        # What one message writes (a head and its first chunk, a last chunk and the terminator, a
        # whole small answer) leaves in one send (messages_api/server/direct_write.py).
        transport = self.channel.transport if self.channel is not None else None
        if not isinstance(transport, DirectWriteServer):
            super().handle_reply(message)
            return
        transport.hold()
        try:
            super().handle_reply(message)
        finally:
            transport.release()

    def handleContentChunk(self, data: bytes) -> None:
        self.body_bytes += len(data)
        limit = self.body_limit
        if self.body_bytes > limit:
            # Only a chunked body gets here: a declared length over the limit was refused earlier.
            channel = self.channel
            if isinstance(channel, GuardedChannel):
                channel.refuse(413, body_too_large_message(limit), TOO_LARGE)
            return
        super().handleContentChunk(data)

    def basic_error(self, status: int, status_text: bytes, body: str) -> None:
        """Daphne's HTML error page (bad path bytes, invalid header, application crash or
        timeout) in Anthropic's envelope; `body` is daphne's one-line reason, never a traceback."""
        request_id = new_request_id()
        self.handle_reply(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"request-id", request_id.encode())],
            }
        )
        self.handle_reply(
            {"type": "http.response.body", "body": orjson.dumps(error_body(error_type_for_status(status), body, request_id))}
        )


class GuardedHTTPFactory(HTTPFactory):  # type: ignore[misc]  # daphne is untyped: HTTPFactory is Any
    """Daphne's HTTP factory, building guarded channels and requests: at most
    GATEWAY_MAX_CONNECTIONS_PER_ADDRESS open connections per client address (a connection past it
    is closed at accept: Twisted closes the socket when `buildProtocol` returns None), each closed
    after GATEWAY_IDLE_CONNECTION_TIMEOUT_S without a request (Twisted's idle timer, `timeOut`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        idle = settings.GATEWAY_IDLE_CONNECTION_TIMEOUT_S
        self.timeOut = idle if idle > 0 else None
        self.open_per_address: Tally[str] = Tally()

    def log(self, request: Any) -> None:
        # Twisted's own access line (combined log format) for every request. At daphne's default
        # verbosity (1) daphne sends Twisted's log nowhere, so the line was formatted for no one:
        # ~20 µs a request, 2 % of the gateway's CPU under a flood of refusals (tenants.py,
        # `limited`). Daphne's access log and the gateway's own are unaffected.
        if getattr(self.server, "verbosity", 1) > 1:
            super().log(request)

    def protocol(self) -> _GenericHTTPChannelProtocol:
        # Twisted's `_genericHTTPChannelProtocolFactory`, with our channel instead of HTTPChannel.
        return _GenericHTTPChannelProtocol(GuardedChannel())  # type: ignore[no-untyped-call]  # untyped Twisted

    def buildProtocol(self, addr: Any) -> _GenericHTTPChannelProtocol | None:
        host = getattr(addr, "host", None)
        cap = settings.GATEWAY_MAX_CONNECTIONS_PER_ADDRESS
        if isinstance(host, str) and cap > 0 and self.open_per_address[host] >= cap:
            connections_refused.inc()
            _log_cap(host, cap)
            return None
        # Daphne sets its WebRequest as request factory.
        protocol: _GenericHTTPChannelProtocol | None = super().buildProtocol(addr)
        if protocol is not None:
            protocol.requestFactory = GuardedRequest
            channel: Any = protocol._channel  # ours (`protocol()` above); Twisted types it as either of its channels
            if isinstance(host, str) and isinstance(channel, GuardedChannel):
                self.open_per_address[host] += 1
                channel._counted = (self, host)
        return protocol

    def connection_closed(self, host: str) -> None:
        left = self.open_per_address[host] - 1
        if left > 0:
            self.open_per_address[host] = left
        else:
            del self.open_per_address[host]


def _log_cap(host: str, cap: int) -> None:
    """One line per refused connection at most AUDIT_UNAUTHENTICATED_SAMPLE_PER_S times a second
    (all are counted in gateway_connections_refused_total)."""
    global _cap_log_sampler
    if _cap_log_sampler is None:
        _cap_log_sampler = RateSampler(settings.AUDIT_UNAUTHENTICATED_SAMPLE_PER_S)
    skipped = _cap_log_sampler.take()
    if skipped is not None:
        logger.warning(
            "closed a connection from %s at accept: %d open from that address already (GATEWAY_MAX_CONNECTIONS_PER_ADDRESS)%s",
            host, cap, f" (and {skipped} more not logged since the last)" if skipped else "",
        )


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # 529 is Anthropic's (overloaded), not HTTP's: HTTPStatus has no phrase for it
        return "Overloaded"


def body_too_large_message(limit: int) -> str:
    return f"Request body is larger than the limit of {limit} bytes"


def install(daphne_server: ModuleType) -> None:
    """Make daphne's `Server.run()` (module `daphne.server`) build the guarded factory."""
    daphne_server.HTTPFactory = GuardedHTTPFactory  # type: ignore[attr-defined]


def _peer(transport: Any) -> str:
    try:
        peer = transport.getPeer()
        return f"{peer.host}:{peer.port}"
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"
