"""Every third-party internal the gateway relies on, in one place.

The gateway reaches past the public APIs of daphne, Twisted, Channels, aiohttp, httpx-aiohttp,
httpx and asyncio where their public paths cost too much per request or per relayed token, or
cannot do what it needs (bounding what a client sends while daphne parses it, writing to the
socket at once, relaying a token in one call). Each such use is listed here: the owner (a module,
class or function, by dotted name), the names read, set, overridden or called on it, our module
that does so and why, and the package version the use was checked against.

tests/unit/disagg_project/test_relied_on.py fails when a name disappears (`missing()`), when a pinned source
changes, and when an installed package's version differs from the one recorded: after an upgrade,
re-check each reliance on that package against its new source, then update `checked_against`.

A name counts as present when the owner has it (class attributes, methods, slots, module
globals) or, for an instance attribute, when the owner's class or one of its bases assigns
`self.<name>` in its source. `missing()` imports every owner (`daphne.server` installs Twisted's
reactor when imported): it is for tests, not for a serving process.

This module imports no product module: owners are named by dotted string.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata

__all__ = ["installed_version", "missing", "PINNED_SOURCES", "PinnedSource", "Reliance", "RELIANCES", "resolve"]


@dataclass(frozen=True)
class Reliance:
    """Names of a third-party module, class or function that our code reads, sets, overrides or
    calls although the package does not document them (or documents them as internal)."""

    owner: str  # dotted name: "twisted.web.http.HTTPChannel"
    names: tuple[str, ...]
    used_by: str  # our module (and where in it)
    why: str
    checked_against: str  # "<distribution> <version>" ("Python 3.11" for the standard library)

    @property
    def package(self) -> str:
        return self.checked_against.rpartition(" ")[0]

    @property
    def version(self) -> str:
        return self.checked_against.rpartition(" ")[2]


@dataclass(frozen=True)
class PinnedSource:
    """A third-party function our code copies (less what it does not need): its source's SHA-256,
    so that a change to the original is looked at rather than drifting from the copy."""

    owner: str  # dotted name of the function
    sha256: str
    used_by: str
    why: str
    checked_against: str

    @property
    def package(self) -> str:
        return self.checked_against.rpartition(" ")[0]

    @property
    def version(self) -> str:
        return self.checked_against.rpartition(" ")[2]


RELIANCES: tuple[Reliance, ...] = (
    # --- daphne ---------------------------------------------------------------------------------
    Reliance(
        "daphne.server", ("HTTPFactory",),
        "messages_api/server/http_guard.py (install)",
        "Server.run() instantiates this module global; install() replaces it with GuardedHTTPFactory",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.http_protocol.HTTPFactory", ("buildProtocol", "protocol"),
        "messages_api/server/http_guard.py (GuardedHTTPFactory)",
        "overridden: our channel in Twisted's protocol wrapper, our request as its request factory",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.http_protocol.WebRequest", ("handleContentChunk", "basic_error", "handle_reply", "channel"),
        "messages_api/server/http_guard.py (GuardedRequest)",
        "a chunked body counted as decoded; daphne's HTML error pages answered in Anthropic's envelope",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.http_protocol.WebRequest", ("process",),
        "messages_api/server/header_gate.py (scope_path), messages_api/server/http_guard.py (allHeadersReceived)",
        "the scope's path is the target's path percent-decoded, its root path a Daphne-Root-Path header (removed): "
        "the key is checked on the path daphne routes",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.server.Server", ("create_application", "handle_reply"),
        "messages_api/server/daphne_request.py (daphne_request)",
        "`send` is partial(server.handle_reply, request): daphne's request behind it, for the body writer and backpressure",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.server.Server", ("connections",),
        "messages_api/server/body_writer.py (body_writer)",
        "the writer repeats handle_reply's connections[request] check",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.http_protocol.WebRequest", ("handle_reply", "finished", "channel", "_response_started", "server"),
        "messages_api/server/body_writer.py (body_writer)",
        "the writer makes WebRequest.handle_reply's checks itself, then writes the chunk in one call",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.http_protocol.WebRequest", ("request_start",),
        "messages_api/server/arrival.py (seconds_since_received)",
        "when daphne parsed the request (send.args[0]): the stream start wait counts from there",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.http_protocol.HTTPFactory", ("server",),
        "messages_api/server/drain.py (_Drain)",
        "finds daphne's server from each listening port's factory",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.server.Server", ("action_logger",),
        "messages_api/server/access_log.py (install)",
        "daphne's access lines go to it (Server.log_action); replaced by a function that logs them off the loop",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.access.AccessLogGenerator", ("stream",),
        "messages_api/server/access_log.py (install)",
        "only the generator writing to stdout (daphne's default) is replaced; --access-log FILE is left alone",
        "daphne 4.2.3",
    ),
    Reliance(
        "daphne.server.Server", ("connections",),
        "messages_api/server/drain.py (_Drain.in_flight)",
        "requests in flight: entries whose 'application_instance' runs and that are not 'disconnected'",
        "daphne 4.2.3",
    ),
    # --- Twisted --------------------------------------------------------------------------------
    Reliance(
        "twisted.web.http.HTTPChannel",
        (
            "dataReceived", "allHeadersReceived", "allContentReceived", "lineLengthExceeded",
            "_respondToBadRequestAndDisconnect", "connectionLost", "setTimeout", "callLater", "length",
            "persistent", "totalHeadersSize", "maxHeaders", "_receivedHeaderSize", "_receivedHeaderCount",
            "_handlingRequest", "_buffer", "line_mode", "MAX_LENGTH",
        ),
        "messages_api/server/http_guard.py (GuardedChannel)",
        "the parser's decision points overridden and its counters read, to refuse a request before daphne",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http.HTTPChannel",
        ("requests", "_command", "_path", "_networkProducer", "_waitingForTransport", "paused", "getPeer"),
        "messages_api/server/http_guard.py (GuardedChannel.allHeadersReceived, _refuse_for, _hold, _key_looked_up; typed by _Channel)",
        "the request's target and headers read once its headers are in; the connection held (not read, not "
        "parsed) while its API key is looked up, and released as Twisted's own flow control would",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.protocols.basic.LineReceiver", ("dataReceived", "paused"),
        "messages_api/server/http_guard.py (GuardedChannel._hold)",
        "its parsing loop stops while `paused` is set, keeping what arrived in its buffer for later",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http.HTTPFactory", ("timeOut", "buildProtocol"),
        "messages_api/server/http_guard.py (GuardedHTTPFactory)",
        "buildProtocol gives each channel the factory's timeOut: the idle timeout (GATEWAY_IDLE_CONNECTION_TIMEOUT_S)",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.tcp.Port", ("doRead",),
        "messages_api/server/http_guard.py (GuardedHTTPFactory.buildProtocol)",
        "a factory whose buildProtocol returns None makes doRead close the accepted socket: the per-address cap",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http._GenericHTTPChannelProtocol", ("_channel",),
        "messages_api/server/http_guard.py (GuardedHTTPFactory.buildProtocol)",
        "the channel inside the wrapper, told which client address it counts against",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http", ("_genericHTTPChannelProtocolFactory", "_GenericHTTPChannelProtocol"),
        "messages_api/server/http_guard.py (GuardedHTTPFactory.protocol)",
        "what HTTPFactory.protocol builds, rebuilt around GuardedChannel",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http._GenericHTTPChannelProtocol", ("requestFactory",),
        "messages_api/server/http_guard.py (GuardedHTTPFactory.buildProtocol)",
        "set to GuardedRequest after daphne set its WebRequest (passed through to the channel)",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http.Request",
        ("write", "startedWriting", "chunked", "sentLength", "_disconnected", "channel", "finished"),
        "messages_api/server/body_writer.py (body_writer)",
        "once the head is out, does what Request.write does (count, frame the chunk) in one write",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.tcp.Port", ("transport",),
        "messages_api/server/direct_write.py (install)",
        "the class of every accepted connection, replaced by DirectWriteServer",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.tcp.Server", ("write", "writeSequence", "socket", "SEND_LIMIT", "TLS"),
        "messages_api/server/direct_write.py (DirectWriteServer)",
        "write() overridden to send on the socket at once when nothing is queued",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.abstract.FileDescriptor",
        (
            "dataBuffer", "offset", "_tempDataLen", "connected", "disconnecting", "_writeDisconnected",
            "_writeDisconnecting", "producer",
        ),
        "messages_api/server/direct_write.py (DirectWriteServer.write)",
        "the send queue is empty and the connection open: a direct send keeps the bytes in order",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http.Request", ("registerProducer", "unregisterProducer", "producer", "finished", "channel"),
        "messages_api/server/backpressure.py (Backpressure.register, close)",
        "a streaming producer registered on the request gets the connection's pause/resume through its channel; "
        "finish() does not unregister it (_cleanup logs an error first), so close() does, before the last frame; "
        "once the connection is lost `channel` is None and only `producer` is cleared",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.web.http.HTTPChannel",
        ("registerProducer", "unregisterProducer", "pauseProducing", "resumeProducing", "stopProducing",
         "_requestProducer", "_waitingForTransport", "transport"),
        "messages_api/server/backpressure.py (Backpressure.register)",
        "the channel, the transport's producer, forwards pause/resume/stop to the request's producer; one registered "
        "while `_waitingForTransport` is already set is not paused by it, so register() pauses it",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.abstract.FileDescriptor",
        ("bufferSize", "write", "_maybePauseProducer", "_isSendBufferFull", "doWrite", "producerPaused",
         "dataBuffer", "offset", "_tempDataLen"),
        "messages_api/server/backpressure.py (Backpressure.register, held_bytes), "
        "messages_api/server/direct_write.py (DirectWriteServer.write: what the socket did not take goes to write)",
        "write() pauses the streaming producer when more than `bufferSize` is queued (set per stream); doWrite "
        "resumes it once the queue is empty; the queue's size is read for the stall check",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.tcp.Connection", ("abortConnection", "socket"),
        "messages_api/server/backpressure.py (Backpressure.close, held_bytes)",
        "a stalled client's connection is dropped with its queue; the kernel's send queue is read from its socket",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.tcp.Port", ("factory",),
        "messages_api/server/drain.py (listening_ports)",
        "a listening port is daphne's when its factory is daphne's HTTPFactory",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.tcp.Port", ("socket",),
        "disagg_project/daphne.py (no_delay_on_listening_sockets)",
        "TCP_NODELAY set on the listening socket, which accepted connections inherit",
        "Twisted 26.10.0",
    ),
    Reliance(
        "twisted.internet.asyncioreactor.AsyncioSelectorReactor", ("_asyncioEventloop",),
        "disagg_project/daphne.py (running_daphne)",
        "the asyncio loop daphne runs: the hooks that run on it (background services, state dump, loop monitor, ...) get it",
        "Twisted 26.10.0",
    ),
    # --- Channels -------------------------------------------------------------------------------
    Reliance(
        "channels.consumer.AsyncConsumer",
        ("__call__", "dispatch", "channel_layer_alias", "scope", "channel_layer", "base_send"),
        "messages_api/consumers/dispatch.py (RequestTask.serve_in_place)",
        "stands in for __call__ without a channel layer, setting what it sets (see PINNED_SOURCES)",
        "channels 4.3.2",
    ),
    Reliance(
        "django.urls.resolvers.RoutePattern", ("match",),
        "messages_api/routes.py (requires_api_key)",
        "the pattern `path()` builds, made directly to match a path as the router's routes do",
        "Django 5.2.19",
    ),
    Reliance(
        "channels.routing.URLRouter", ("__call__", "routes"),
        "messages_api/routes.py (requires_api_key)",
        "strips the path's leading slashes, then matches each route's pattern: the key check matches the same way",
        "channels 4.3.2",
    ),
    Reliance(
        "channels.generic.http.AsyncHttpConsumer", ("body", "send_body"),
        "messages_api/consumers/base.py (ApiConsumer)",
        "a refused request's collected body dropped; send_body overridden for the direct writer",
        "channels 4.3.2",
    ),
    # --- aiohttp --------------------------------------------------------------------------------
    # Two modules, nothing else: workers/wire/push.py (the response's reader, read or pushed) and
    # workers/wire/connection.py (the connection's protocol and its parser).
    Reliance(
        "aiohttp.streams.StreamReader",
        ("_waiter", "_buffer", "_eof", "_exception", "_low_water", "_protocol", "_read_nowait"),
        "workers/wire/push.py (PushedBody, push_body, ResponseStream.read)",
        "a push stands in for the reader's waiter and drains its buffer; a lost connection's last bytes first",
        "aiohttp 3.14.5",
    ),
    Reliance(
        "aiohttp.base_protocol.BaseProtocol", ("_parser", "_reading_paused", "resume_reading", "transport"),
        "workers/wire/push.py (push_body, PushedBody)",
        "finds the RelayedBodyParser in the connection's parser slot; resumes a connection paused before the push",
        "aiohttp 3.14.5",
    ),
    Reliance(
        "aiohttp.client_proto.ResponseHandler",
        (
            "data_received", "set_response_params", "_parser", "_tail", "_read_timeout", "_read_timeout_handle",
            "_reschedule_timeout",
        ),
        "workers/wire/connection.py (WorkerResponseHandler)",
        "wraps the parser set_response_params makes, and counts a connection's requests there (called once per "
        "request, in the request's task: workers.wire.connection.connection_reused); skips data_received (restart "
        "the read timer, feed the parser)",
        "aiohttp 3.14.5",
    ),
    Reliance(
        "aiohttp.connector.BaseConnector", ("_factory", "_loop"),
        "workers/wire/connection.py (use_worker_protocol)",
        "the factory each connection's protocol is built with, replaced by WorkerResponseHandler",
        "aiohttp 3.14.5",
    ),
    Reliance(
        "aiohttp.http.HttpResponseParser", ("feed_data", "feed_eof", "pause_reading"),
        "workers/wire/connection.py (RelayedBodyParser)",
        "aiohttp's (C) parser gets the head alone, and flow control, through the parser's own interface",
        "aiohttp 3.14.5",
    ),
    Reliance(
        "aiohttp.http.RawResponseMessage", ("code", "chunked"),
        "workers/wire/connection.py (RelayedBodyParser._head)",
        "a parsed head says whether a chunked body (decoded here) or an informational head follows",
        "aiohttp 3.14.5",
    ),
    Reliance(
        "aiohttp.streams.StreamReader", ("feed_data", "feed_eof", "set_exception"),
        "workers/wire/connection.py (RelayedBodyParser._body, _fail)",
        "a body decoded here reaches the response's reader as aiohttp's parser would feed it",
        "aiohttp 3.14.5",
    ),
    # --- httpx-aiohttp, httpx -------------------------------------------------------------------
    Reliance(
        "httpx_aiohttp.AiohttpTransport", ("client", "get_client", "limits", "ssl_context", "handle_async_request"),
        "workers/wire/transport.py (WorkerTransport)",
        "our session built from the limits and SSL context the package keeps; its request path replaced",
        "httpx-aiohttp 0.2.0",
    ),
    Reliance(
        "httpx.Response", ("stream",),
        "workers/wire/push.py (push_body, body_reader)",
        "finds our ResponseStream (and the aiohttp reader in it) behind an httpx response",
        "httpx 0.29.0",
    ),
    # --- asyncio --------------------------------------------------------------------------------
    Reliance(
        "asyncio.selector_events._SelectorTransport", ("max_size",),
        "workers/wire/push.py (PushedBody)",
        "while a body is pushed, the connection reads at most PUSH_READ_BYTES at once",
        "Python 3.11",
    ),
    Reliance(
        "asyncio.Task", ("_fut_waiter",),
        "messages_api/server/state_dump.py (dump_tasks)",
        "the SIGUSR1 dump names the future each task is suspended on",
        "Python 3.11",
    ),
    # --- OpenTelemetry ----------------------------------------------------------------------------
    Reliance(
        "opentelemetry.sdk.trace.export.BatchSpanProcessor", ("_batch_processor",),
        "disagg_project/telemetry.py (_counted_batch_processor)",
        "the span processor's queue and thread, whose metrics hook is replaced",
        "opentelemetry-sdk 1.45.2",
    ),
    Reliance(
        "opentelemetry.sdk._shared_internal.BatchProcessor", ("_metrics",),
        "disagg_project/telemetry.py (_counted_batch_processor)",
        "replaced by _DropCounter: a full queue's drops are reported only there (drop_items), and "
        "are counted in gateway_trace_spans_dropped_total",
        "opentelemetry-sdk 1.45.2",
    ),
    Reliance(
        "opentelemetry.sdk._shared_internal.BatchProcessor", ("_export",),
        "disagg_project/telemetry.py (_CountingExporter.export)",
        "hands the exporter a list it builds per batch and never reads after `export` returns, so "
        "the exporter's wrapper empties it (a failed export's reference cycles would hold its spans)",
        "opentelemetry-sdk 1.45.2",
    ),
    Reliance(
        "opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter",
        ("_shutdown", "_metrics", "_max_request_size", "_client"),
        "disagg_project/otlp_exporter.py (OtlpSpanExporter.export)",
        "the official export method, copied with our encoder in place of the official one, reads "
        "them as the original does",
        "opentelemetry-exporter-otlp-proto-http 1.45.2",
    ),
    Reliance(
        "opentelemetry.exporter.otlp.proto.http._common", ("_is_request_too_large", "RequestPayloadTooLargeError"),
        "disagg_project/otlp_exporter.py (OtlpSpanExporter.export)",
        "the size limit's check and error, as the copied export method uses them",
        "opentelemetry-exporter-otlp-proto-http 1.45.2",
    ),
)

PINNED_SOURCES: tuple[PinnedSource, ...] = (
    PinnedSource(
        "channels.consumer.AsyncConsumer.__call__",
        "e52238720872dbc3f854519bc971aa7eb41553e63c8729081549ce42465ee419",
        "messages_api/consumers/dispatch.py (RequestTask.serve_in_place)",
        "serve_in_place is this method less its channel-layer branch: a change here is a change to copy",
        "channels 4.3.2",
    ),
    PinnedSource(
        "opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter.export",
        "0968825cd72fb0bde91a72f0607e4e71d622816a087107f6a7053d679aa02f8e",
        "disagg_project/otlp_exporter.py (OtlpSpanExporter.export)",
        "the copy differs only in its encoding line (disagg_project.otlp_encoding: the same bytes, "
        "a third of the CPU): a change here is a change to copy",
        "opentelemetry-exporter-otlp-proto-http 1.45.2",
    ),
)


def resolve(dotted: str) -> object:
    """The module, class or function named `dotted` (its longest importable prefix, then
    attributes); ImportError or AttributeError when it is gone."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(f"no module in {dotted!r}")


def installed_version(package: str) -> str:
    """The installed version of a distribution ("Python": the interpreter's major.minor)."""
    if package == "Python":
        return f"{sys.version_info.major}.{sys.version_info.minor}"
    return metadata.version(package)


def missing(
    reliances: Iterable[Reliance] = RELIANCES, pinned: Iterable[PinnedSource] = PINNED_SOURCES
) -> list[str]:
    """What no longer exists, or no longer matches its pin, each as "<owner>.<name>: ..."."""
    gone: list[str] = []
    for reliance in reliances:
        try:
            owner = resolve(reliance.owner)
        except (ImportError, AttributeError) as exc:
            gone.append(f"{reliance.owner}: cannot be found ({exc}); used by {reliance.used_by}")
            continue
        gone.extend(
            f"{reliance.owner}.{name}: no longer exists; used by {reliance.used_by}"
            for name in reliance.names
            if not _has(owner, name)
        )
    for pin in pinned:
        try:
            source = inspect.getsource(resolve(pin.owner))  # type: ignore[arg-type]  # a function, or getsource raises
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            gone.append(f"{pin.owner}: cannot be found ({exc}); copied by {pin.used_by}")
            continue
        if hashlib.sha256(source.encode()).hexdigest() != pin.sha256:
            gone.append(f"{pin.owner}: its source changed; check the copy in {pin.used_by} against it, then re-pin")
    return gone


def _has(owner: object, name: str) -> bool:
    """`owner` has `name`, or (a class) a method of it or of a base assigns `self.<name>`."""
    if hasattr(owner, name):
        return True
    if not isinstance(owner, type):
        return False
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=(?!=)")
    return any(assigned.search(source) for cls in owner.__mro__ for source in _method_sources(cls))


def _method_sources(cls: type) -> Iterable[str]:
    """The source of each function defined in `cls`'s body (read through the functions, not the
    class: httpx, for one, renames its classes' module, which hides a class from `getsource`)."""
    for value in vars(cls).values():
        function = getattr(value, "__func__", value)  # a classmethod's or staticmethod's function
        if inspect.isfunction(function):
            try:
                yield inspect.getsource(function)
            except OSError:
                continue
