"""The HTTP intake guard (messages_api/server/http_guard.py), against a real daphne process on real sockets:
body limits before buffering, the read deadline, and Twisted's and daphne's own rejections in
Anthropic's envelope. None of the requests but one carries an API key: the guard acts before the
application exists (the requests whose body matters go to an API path that needs no key,
`/v1/files`, which the gateway answers 404; what the headers decide, the key among it, is
tests/e2e/test_header_gate.py). The last tests check the daphne and Twisted internals the guard
relies on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import daphne.server
import pytest
from daphne.http_protocol import HTTPFactory
from daphne.server import Server
from twisted.web.http import HTTPChannel
from twisted.web.http import HTTPFactory as TwistedHTTPFactory

from messages_api.server import http_guard
from messages_api.server.http_guard import GuardedChannel, GuardedHTTPFactory, GuardedRequest
from tests.support.conversation import Conversation, exchange
from tests.support.gateway import Gateway

LIMIT = 100_000
READ_TIMEOUT_S = 1.5
GUARD_ENV = {"MESSAGES_MAX_BODY_BYTES": str(LIMIT), "MESSAGES_BODY_READ_TIMEOUT_S": str(READ_TIMEOUT_S)}


@pytest.fixture
def guarded(gateways: Callable[..., Gateway]) -> Gateway:
    return gateways(**GUARD_ENV)


# An API path that needs no key (answered 404 once the body is in): the body limits and deadline
# are the same on every path, and a key route would refuse a keyless request at its headers.
NO_KEY_PATH = "/v1/files"


def post_head(length: int | None, *extra: str, path: str = NO_KEY_PATH) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    lines = [f"POST {path} HTTP/1.1", "host: gateway", "content-type: application/json", framing, *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# --- the body limit --------------------------------------------------------------------------


def test_a_declared_length_over_the_limit_is_refused_before_the_body(guarded: Gateway) -> None:
    answer = exchange(guarded, post_head(400_000_000))  # and not a byte of the body
    assert answer.status == 413
    error = answer.envelope()
    assert error == {"type": "request_too_large", "message": f"Request body is larger than the limit of {LIMIT} bytes"}
    assert answer.headers["connection"] == "close"
    assert answer.closed


def test_expect_100_continue_is_answered_413_instead(guarded: Gateway) -> None:
    answer = exchange(guarded, post_head(LIMIT + 1, "expect: 100-continue"))
    assert answer.status == 413  # and Conversation.answer checked no `100 Continue` came first


def test_a_refused_client_that_keeps_sending_is_dropped_after_the_linger(guarded: Gateway) -> None:
    conversation = Conversation(guarded.port)
    try:
        conversation.send(post_head(400_000_000))
        answer = conversation.answer(wait_close=0)
        assert answer.status == 413
        # Still writing after the answer: read and dropped for LINGER_S, then the connection ends.
        deadline = time.monotonic() + http_guard.LINGER_S + 3.0
        with pytest.raises(OSError):
            while time.monotonic() < deadline:
                conversation.send(b"x" * 1024)
                time.sleep(0.02)  # a slow writer: the linger, not a full buffer, must end it
        assert time.monotonic() - conversation.started >= http_guard.LINGER_S
    finally:
        conversation.close()


def test_a_chunked_body_is_cut_at_the_limit(guarded: Gateway) -> None:
    # Twice the limit and no last chunk: only a cut at the limit can answer this request.
    conversation = Conversation(guarded.port)
    try:
        conversation.send(post_head(None) + b"".join(chunk(b"x" * 10_000) for _ in range(2 * LIMIT // 10_000)))
        answer = conversation.answer()
    finally:
        conversation.close()
    assert answer.status == 413
    assert answer.envelope() == {"type": "request_too_large", "message": f"Request body is larger than the limit of {LIMIT} bytes"}
    assert answer.closed


def test_a_body_at_the_limit_reaches_the_application(guarded: Gateway, transactional_db: Any) -> None:
    from messages_api.auth import create_api_key

    _, key = create_api_key("http-guard-at-the-limit")
    body = b'{"pad": "' + b"x" * (LIMIT - 11) + b'"}'
    assert len(body) == LIMIT
    for head in (post_head(len(body), f"x-api-key: {key}", path="/v1/messages"), post_head(None, f"x-api-key: {key}", path="/v1/messages")):
        payload = body if b"content-length" in head else chunk(body[:LIMIT // 2]) + chunk(body[LIMIT // 2:]) + b"0\r\n\r\n"
        answer = exchange(guarded, head + payload, wait_close=0)
        # The consumer answered: the body went through and was found to be no Messages request.
        assert answer.status == 400
        assert answer.envelope()["type"] == "invalid_request_error"


# --- the read deadline -----------------------------------------------------------------------


def test_a_slow_upload_is_cut_after_the_read_timeout(guarded: Gateway) -> None:
    conversation = Conversation(guarded.port)
    conversation.send(post_head(1000))
    conversation.send_in_background([b"x"] * 1000, pause=0.1)
    try:
        answer = conversation.answer()
    finally:
        conversation.close()
    assert answer.status == 408
    assert answer.envelope() == {"type": "timeout_error", "message": f"The request was not received within {READ_TIMEOUT_S:g} seconds"}
    assert READ_TIMEOUT_S <= answer.at < READ_TIMEOUT_S + 2.0
    assert answer.closed


def test_slow_headers_are_cut_after_the_read_timeout(guarded: Gateway) -> None:
    conversation = Conversation(guarded.port)
    head = b"GET /health HTTP/1.1\r\nhost: gateway\r\n" + b"x-slow: " + b"y" * 500
    conversation.send_in_background([bytes([b]) for b in head], pause=0.05)
    try:
        answer = conversation.answer()
    finally:
        conversation.close()
    assert answer.status == 408
    assert READ_TIMEOUT_S <= answer.at < READ_TIMEOUT_S + 2.0


def test_each_request_on_a_kept_alive_connection_has_its_own_clock(guarded: Gateway) -> None:
    request = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    conversation = Conversation(guarded.port)
    try:
        conversation.send(request)
        first = conversation.answer(wait_close=0.2)
        assert first.status == 200 and not first.closed
        time.sleep(READ_TIMEOUT_S + 0.5)  # idle past the read timeout between requests
        conversation.send(request)
        second = conversation.answer(wait_close=0)
        assert second.status == 200
    finally:
        conversation.close()


# --- malformed HTTP --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "status", "message"),
    [
        (b"NONSENSE\r\n\r\n", 400, "The request line or headers are malformed"),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400, "The request line or headers are malformed"),
        (b"GET / HTTP/1.1\r\nbad name: v\r\n\r\n", 400, "The request line or headers are malformed"),
        (b"POST / HTTP/1.1\r\ncontent-length: ten\r\n\r\n", 400, "The request line or headers are malformed"),
        (post_head(None) + b"zz\r\n", 400, "The request body's chunked encoding is malformed"),
        (b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", 431, "A request line or header is longer than the limit of 16384 bytes"),
        (b"GET / HTTP/1.1\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n", 431, "A request line or header is longer than the limit of 16384 bytes"),
        (
            b"GET / HTTP/1.1\r\n" + b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 1000) for i in range(20)) + b"\r\n",
            431,
            "The request line and headers are larger than the limit of 16384 bytes",
        ),
        (
            b"GET / HTTP/1.1\r\n" + b"".join(b"x-%d: a\r\n" % i for i in range(600)) + b"\r\n",
            431,
            "The request has more than the limit of 500 headers",
        ),
    ],
    ids=["request-line", "header-no-colon", "header-name", "content-length", "chunk-size", "long-request-line",
         "long-header", "headers-total", "header-count"],
)
def test_what_twisted_rejects_is_answered_in_the_envelope(guarded: Gateway, data: bytes, status: int, message: str) -> None:
    answer = exchange(guarded, data)
    assert answer.status == status
    error = answer.envelope()
    assert error == {"type": "request_too_large" if status == 431 else "invalid_request_error", "message": message}
    assert answer.closed


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # Twisted lets bytes 0x7f-0xb0 through the request target; daphne cannot decode them.
        (b"GET /v1/\x80 HTTP/1.1\r\nhost: gateway\r\n\r\n", "Invalid characters in path"),
        (b"GET /v1/messages?q=\x80 HTTP/1.1\r\nhost: gateway\r\n\r\n", "Invalid query string"),
        (b"GET / HTTP/1.1\r\nhost: gateway\r\nx-v: a\x0bb\r\n\r\n", "Invalid header value"),
    ],
    ids=["path", "query", "header-value"],
)
def test_what_daphne_rejects_is_answered_in_the_envelope(guarded: Gateway, data: bytes, message: str) -> None:
    answer = exchange(guarded, data, wait_close=0)
    assert answer.status == 400
    assert answer.envelope() == {"type": "invalid_request_error", "message": message}


# --- the internals relied on -------------------------------------------------------------------


def test_daphne_runs_the_factory_named_in_its_module() -> None:
    # Server.run() instantiates the module global `HTTPFactory` (what install() replaces); the
    # tests above show a real daphne answering through the guarded one.
    assert "HTTPFactory" in Server.run.__code__.co_names
    assert daphne.server.HTTPFactory in (HTTPFactory, GuardedHTTPFactory)


def test_the_factory_builds_guarded_channels_and_requests() -> None:
    server = Server(application=None, endpoints=["tcp:port=0:interface=127.0.0.1"], signal_handlers=False)
    protocol = GuardedHTTPFactory(server).buildProtocol(None)
    assert protocol is not None
    assert type(protocol._channel) is GuardedChannel
    assert protocol.requestFactory is GuardedRequest
    assert protocol._channel.requestFactory is GuardedRequest


def test_the_overrides_replace_methods_twisted_defines_on_these_classes() -> None:
    # That every internal overridden or read still exists: tests/unit/disagg_project/test_relied_on.py.
    for name in ("allHeadersReceived", "allContentReceived", "_respondToBadRequestAndDisconnect", "dataReceived"):
        assert name in vars(HTTPChannel), name
    assert "handleContentChunk" in vars(HTTPChannel.requestFactory)
    assert "basic_error" in vars(http_guard.WebRequest)
    assert "log" in vars(TwistedHTTPFactory) and "_logFormatter" in vars(TwistedHTTPFactory())


@pytest.mark.parametrize(("verbosity", "written"), [(1, False), (2, True)])
def test_twisteds_access_line_is_formatted_only_where_daphne_sends_twisteds_log(verbosity: int, written: bool) -> None:
    # At daphne's default verbosity Twisted's log goes nowhere: its per-request line is skipped.
    server = Server(application=None, endpoints=["tcp:port=0:interface=127.0.0.1"], signal_handlers=False, verbosity=verbosity)
    factory = GuardedHTTPFactory(server)
    lines: list[str] = []
    factory._logFormatter = lambda timestamp, request: "a line"
    factory._logFile = type("Sink", (), {"write": lambda self, line: lines.append(line)})()
    factory.log(object())
    assert lines == (["a line\n"] if written else [])
