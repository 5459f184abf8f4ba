"""The HTTP intake guard: what a client sends is bounded while daphne's parser reads it.

Daphne serves HTTP/1.1 through Twisted's parser, which writes a request's whole body to a file
before daphne looks at the request, then queues it to the application all at once; Twisted's own
rejections are bare (an empty `400`, or the connection closed without an answer), and its idle
timer restarts on every byte. This module plugs into the parser where each of these is decided,
per connection, before any application runs:

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

The classes here only adapt Twisted and daphne: what each event earns (status, message, type),
the answer's bytes and the audit row of an unauthenticated refusal are decided in
messages_api/server/refusals.py, each answer in Anthropic's envelope with a `request-id` header.

How a refusal ends: the answer is written with `connection: close`, the write side is shut (a FIN
after the answer) and whatever the client still sends is read and dropped, for at most
`LINGER_S`; then the connection is aborted. Closing at once with unread input would make the
kernel send a reset, which can destroy the answer before a client that is still writing its body
reads it.

Installation: `install()` makes daphne's `Server.run()` build its HTTP factory from
`GuardedHTTPFactory` (it instantiates the module global `daphne.server.HTTPFactory`); it is one of
the hooks of disagg_project/daphne.py. Every daphne and Twisted internal used here is listed in
disagg_project/relied_on.py (an override of a method that was renamed would silently do nothing);
tests/unit/disagg_project/test_relied_on.py fails when an upgrade changes one. Measurements and history:
bench/results/2026-12-06-daphne-hooks-history.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, cast

from daphne.http_protocol import HTTPFactory, WebRequest
from django.conf import settings
from prometheus_client import Counter
from twisted.internet.base import DelayedCall
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol

from messages_api.audit import RateSampler
from messages_api.auth import Principal
from messages_api.request_context import loggable
from messages_api.server import header_gate, refusals
from messages_api.server.direct_write import DirectWriteServer
from messages_api.server.header_gate import Refusal

__all__ = ["GuardedChannel", "GuardedHTTPFactory", "GuardedRequest", "install"]

logger = logging.getLogger(__name__)

# How long a refused connection keeps reading (and dropping) what the client still sends, so the
# answer is not destroyed by a reset while the client is busy writing. Loopback drains a 400 MB
# upload in well under this; a client on a slow link that never reads while writing loses the
# answer either way.
LINGER_S = 2.0

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


# --- the Twisted attributes the channel reads, typed --------------------------------------------
# Twisted leaves HTTPChannel's methods unannotated (each call an untyped call to mypy), types
# `_path` by the Request it also stores there, and declares its zope interfaces' methods without
# `self` (which mypy, without the zope plugin, cannot call on an instance). `GuardedChannel._twisted`
# is the channel itself seen through these Protocols.


class _Producer(Protocol):
    """The transport as the channel's push producer (`_networkProducer`: IPushProducer)."""

    def pauseProducing(self) -> None: ...
    def resumeProducing(self) -> None: ...


class _Transport(Protocol):
    """The connection's transport (ITCPTransport; `DirectWriteServer` under the gateway)."""

    def write(self, data: bytes) -> None: ...
    def abortConnection(self) -> None: ...
    def getPeer(self) -> Any: ...


class _Channel(Protocol):
    """What GuardedChannel reads and calls of Twisted's HTTPChannel (listed in relied_on.py)."""

    _path: bytes  # the request line's target, kept until the request's content is complete
    _networkProducer: _Producer
    transport: _Transport | None

    def callLater(self, seconds: float, call: Callable[[], None]) -> DelayedCall: ...
    def setTimeout(self, period: float | None) -> object: ...
    def getPeer(self) -> Any: ...
    def loseConnection(self) -> None: ...


class GuardedChannel(HTTPChannel):
    """Twisted's HTTP/1.1 channel with the limits above; everything after a request's body has
    arrived (daphne's processing, the response, disconnect detection) is Twisted's own. Each
    override asks a function of messages_api/server/refusals.py (or header_gate) for its verdict
    and carries it out."""

    # The super() calls below hand on to HTTPChannel's unannotated handlers: each is an untyped
    # call to mypy.

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

    @property
    def _twisted(self) -> _Channel:
        """This channel, typed as what it reads of Twisted (see `_Channel`)."""
        return cast(_Channel, self)

    def dataReceived(self, data: bytes) -> None:
        if self._refused is not None:
            return  # lingering after a refusal: read and drop
        if self._intake_deadline is None and not self._handlingRequest:
            # The first byte of a request (the connection's first, or the next on a kept-alive
            # connection) starts its clock; Twisted's idle timer restarts on every byte.
            timeout = settings.MESSAGES_BODY_READ_TIMEOUT_S
            self._intake_deadline = self._twisted.callLater(timeout, self._intake_timed_out)
        super().dataReceived(data)  # type: ignore[no-untyped-call]
        if self._key_lookup is not None:
            # Held (the parser keeps what came in its buffer): the transport may have been resumed
            # by Twisted's write-side flow control; no more than this read is taken meanwhile.
            self._twisted._networkProducer.pauseProducing()

    def allHeadersReceived(self) -> None:
        twisted = self._twisted
        target = twisted._path
        request = self.requests[-1]
        limit = header_gate.body_limit(target)
        if isinstance(request, GuardedRequest):
            request.body_limit = limit  # for a chunked body, counted as it is decoded
        # `length` is the declared Content-Length (None when chunked), known before the body.
        too_large = refusals.declared_length_refusal(self.length, limit)
        if too_large is not None:
            self.refuse(too_large)
            return  # not Twisted's: no `100 Continue`, no body file
        headers = request.requestHeaders
        # Daphne takes the scope's root path from this header, which would let a client move the
        # path the router matches away from the one checked below; no deployment of ours sets it.
        headers.removeHeader(b"daphne-root-path")
        peer = twisted.getPeer() if self.transport is not None else None
        verdict = header_gate.check(target, headers, getattr(peer, "host", None))
        if isinstance(verdict, Refusal):
            self._refuse_for(verdict)
            return
        if isinstance(verdict, header_gate.KeyLookup):
            self._hold(verdict.future)
            return
        super().allHeadersReceived()  # type: ignore[no-untyped-call]

    def allContentReceived(self) -> None:
        if self._refused is not None:
            return  # a refused request never reaches daphne
        if self._key_lookup is not None:
            self._content_waits = True  # a request without a body, complete while its key is looked up
            return
        self._cancel(self._intake_deadline)
        self._intake_deadline = None
        super().allContentReceived()  # type: ignore[no-untyped-call]

    # --- the key's lookup -----------------------------------------------------------------------

    def _hold(self, lookup: asyncio.Future[Principal | None]) -> None:
        """Stop reading and parsing this connection until `lookup` says whether the key is valid:
        what has arrived of the body stays in the parser's buffer, the rest in the socket."""
        self._key_lookup = lookup
        self.paused = True  # LineReceiver's loop stops at this flag
        self._twisted._networkProducer.pauseProducing()
        lookup.add_done_callback(self._key_looked_up)

    def _key_looked_up(self, lookup: asyncio.Future[Principal | None]) -> None:
        if self._key_lookup is not lookup or self._refused is not None or self.transport is None:
            return  # the connection ended, or the request was refused (its read deadline) meanwhile
        self._key_lookup = None
        refusal = refusals.key_lookup_refusal(lookup)
        if refusal is not None:
            self._refuse_for(refusal)
            return
        super().allHeadersReceived()  # type: ignore[no-untyped-call]  # the `100 Continue`, the body file
        if self._content_waits:
            self._content_waits = False
            self.allContentReceived()
        self.paused = False
        if not self._waitingForTransport:
            self._twisted._networkProducer.resumeProducing()
        self.dataReceived(b"")  # parse what arrived meanwhile

    def _refuse_for(self, refusal: Refusal) -> None:
        if not refusal.unauthenticated:
            self.refuse(refusal)
            return
        # Counted always, its audit row (and access log line) only sampled: logged there, not here.
        request_id = refusals.record_unauthenticated(refusal, self._command, self._twisted._path)
        self.refuse(refusal, request_id=request_id, log=False)

    def lineLengthExceeded(self, line: bytes) -> None:
        self.refuse(refusals.line_too_long(self.MAX_LENGTH))

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's one answer for every parse failure; its counters say which limit it was.
        self.refuse(
            refusals.parse_failure(
                header_bytes=self._receivedHeaderSize,
                header_bytes_limit=self.totalHeadersSize,
                header_count=self._receivedHeaderCount,
                header_count_limit=self.maxHeaders,
                in_headers=bool(self.line_mode),
            )
        )

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel(self._intake_deadline)
        self._cancel(self._linger)
        self._key_lookup = None
        counted, self._counted = self._counted, None
        if counted is not None:
            counted[0].connection_closed(counted[1])
        super().connectionLost(reason)  # type: ignore[no-untyped-call]

    # --- the refusal ----------------------------------------------------------------------------

    def refuse(self, refusal: Refusal, *, request_id: str | None = None, log: bool = True) -> None:
        """Answer `refusal` in Anthropic's envelope, stop parsing, and close (lingering)."""
        twisted = self._twisted
        transport = twisted.transport
        if self._refused is not None or transport is None:
            return
        status = refusal.status
        self._refused = status
        self._cancel(self._intake_deadline)
        self._intake_deadline = None
        # Twisted's idle timer: the linger decides from now on.
        twisted.setTimeout(None)
        self._buffer = b""  # input the line parser has not reached is never parsed now
        self.persistent = False
        if self._key_lookup is not None:
            # Held for a key lookup: read again, so the linger drains what the client still sends.
            self._key_lookup = None
            twisted._networkProducer.resumeProducing()
        refused.labels(status=str(status)).inc()
        if log:
            logger.info("refused a request from %s with %s: %s", _peer(transport), status, loggable(refusal.message))
        transport.write(refusals.refusal_bytes(refusal, request_id))
        lose_write = getattr(transport, "loseWriteConnection", None)
        if lose_write is None:
            twisted.loseConnection()
            return
        lose_write()
        self._linger = twisted.callLater(LINGER_S, self._end_linger)

    def _intake_timed_out(self) -> None:
        self._intake_deadline = None
        if not self._handlingRequest:
            self.refuse(refusals.read_timed_out(settings.MESSAGES_BODY_READ_TIMEOUT_S))

    def _end_linger(self) -> None:
        self._linger = None
        transport = self._twisted.transport
        if transport is not None:
            transport.abortConnection()

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
                channel.refuse(refusals.body_too_large(limit))
            return
        super().handleContentChunk(data)

    def basic_error(self, status: int, status_text: bytes, body: str) -> None:
        """Daphne's HTML error page (bad path bytes, invalid header, application crash or
        timeout) in Anthropic's envelope; `body` is daphne's one-line reason, never a traceback."""
        for message in refusals.error_page(status, body):
            self.handle_reply(message)


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
        # Twisted's own access line (combined log format) for every request, only where daphne
        # sends Twisted's log: at its default verbosity (1) it goes nowhere, so it is not formatted.
        # Daphne's access log and the gateway's own are unaffected.
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


def install(daphne_server: ModuleType) -> None:
    """Make daphne's `Server.run()` (module `daphne.server`) build the guarded factory."""
    daphne_server.HTTPFactory = GuardedHTTPFactory  # type: ignore[attr-defined]


def _peer(transport: Any) -> str:
    try:
        peer = transport.getPeer()
        return f"{peer.host}:{peer.port}"
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"
