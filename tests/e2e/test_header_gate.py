"""What a request's headers alone decide, before its body is read (messages_api/server/header_gate.py),
against real daphne processes on real sockets: the API key of every API route, ambiguous
credentials, who may read /metrics (the socket's own peer, never a forwarded header), and the
Cookie header's cap."""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from django.conf import settings

from tests.support.conversation import Answer, Conversation, exchange
from tests.support.gateway import Gateway
from tests.support.prometheus import metric_value

pytestmark = pytest.mark.django_db(transaction=True)

DECLARED = 30_000_000  # under the default 32 MiB limit: only the key can refuse it before the body
ROUTES = [
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/some-model"),
    ("POST", "/v1/%6dessages"),  # the path daphne routes on is percent-decoded
    ("POST", "//v1/messages"),  # and the router strips the leading slashes
]


@pytest.fixture
def key(transactional_db: Any) -> str:
    from messages_api.auth import create_api_key

    _, key = create_api_key(f"header-gate-{time.monotonic_ns()}")
    return key


def unknown_key() -> str:
    return "sk-gw-" + secrets.token_urlsafe(32)  # well-formed, and in no database


def head(method: str, path: str, *headers: str, length: int | None = DECLARED) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", "anthropic-version: 2023-06-01", "content-type: application/json"]
    if length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode("latin-1")


def refused_before_the_body(gateway: Gateway, data: bytes) -> Answer:
    """Send a head that declares a body and never send the body: only a refusal made from the
    headers can answer it (else the gateway waits for the body until its read deadline)."""
    conversation = Conversation(gateway.port)
    try:
        conversation.send(data)
        return conversation.answer(timeout=5.0)
    finally:
        conversation.close()


# --- the key, at the headers ---------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m}-{p}" for m, p in ROUTES])
@pytest.mark.parametrize("credential", ["none", "unknown", "unknown-bearer", "unknown-again"])
def test_no_valid_key_is_refused_before_the_body_on_every_api_route(gateway: Gateway, method: str, path: str, credential: str) -> None:
    wrong = unknown_key()
    headers = {
        "none": [],
        "unknown": [f"x-api-key: {wrong}"],
        "unknown-bearer": [f"authorization: Bearer {wrong}"],
        "unknown-again": [f"x-api-key: {wrong}"],
    }[credential]
    if credential == "unknown-again":  # the second time, the cached miss answers without the database
        assert refused_before_the_body(gateway, head(method, path, *headers)).status == 401
    answer = refused_before_the_body(gateway, head(method, path, *headers))
    assert answer.status == 401
    message = "x-api-key header is required" if credential == "none" else "invalid x-api-key"
    assert answer.envelope() == {"type": "authentication_error", "message": message}
    assert answer.at < 2.0  # bench/uploads.py measures it: within milliseconds
    assert answer.closed


def test_a_wrong_key_gets_no_100_continue(gateway: Gateway) -> None:
    answer = refused_before_the_body(gateway, head("POST", "/v1/messages", f"x-api-key: {unknown_key()}", "expect: 100-continue"))
    assert answer.status == 401  # and Conversation.answer checked no `100 Continue` came first


def test_a_valid_key_gets_its_body_read(gateway: Gateway, key: str) -> None:
    """The first request with a key looks it up (the connection is held meanwhile), the next ones
    find it cached; either way the body is read and the consumer answers."""
    body = b'{"model": 1}'
    for _ in range(2):
        conversation = Conversation(gateway.port)
        try:
            conversation.send(head("POST", "/v1/messages", f"x-api-key: {key}", "expect: 100-continue", length=len(body)))
            conversation.sock.settimeout(5)
            assert conversation.sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            conversation.send(body)
            answer = conversation.answer(wait_close=0)
        finally:
            conversation.close()
        assert answer.status == 400 and answer.envelope()["type"] == "invalid_request_error"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_sent_with_the_head_waits_for_the_key_s_lookup(gateway: Gateway, framing: str, transactional_db: Any) -> None:
    """A key the cache has not seen: the body, already in the parser's buffer with the head, is
    parsed once the lookup says the key is valid (a new key each time: each is looked up)."""
    from messages_api.auth import create_api_key

    _, fresh = create_api_key(f"header-gate-fresh-{framing}")
    body = b'{"model": 1}'
    if framing == "chunked":
        data = head("POST", "/v1/messages", f"x-api-key: {fresh}", "transfer-encoding: chunked", length=None)
        data += b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        data = head("POST", "/v1/messages", f"x-api-key: {fresh}", length=len(body)) + body
    answer = exchange(gateway, data, wait_close=0)
    assert answer.status == 400 and answer.envelope()["type"] == "invalid_request_error"


def test_refusals_at_the_headers_are_counted_and_sampled_as_unauthenticated(gateway: Gateway) -> None:
    def count() -> float:
        text = httpx.get(gateway.url + "/metrics", timeout=5).text
        try:
            return metric_value(text, "gateway_unauthenticated_rejections_total")
        except AssertionError:
            return 0.0

    before = count()
    for _ in range(5):
        assert refused_before_the_body(gateway, head("POST", "/v1/messages")).status == 401
    assert count() - before == 5


@pytest.mark.parametrize("path", ["/nothing", "/v1/files", "/admin/login/", "/V1/MESSAGES"])
def test_no_other_path_gets_a_large_body_read(gateway: Gateway, path: str) -> None:
    """Without this, a request without a key took its 30 MB to a path that needs none: Django's
    pages and unknown paths take at most Django's own DATA_UPLOAD_MAX_MEMORY_SIZE."""
    limit = min(settings.MESSAGES_MAX_BODY_BYTES, settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
    answer = refused_before_the_body(gateway, head("POST", path))
    assert answer.status == 413
    assert answer.envelope() == {"type": "request_too_large", "message": f"Request body is larger than the limit of {limit} bytes"}
    # A chunked body is cut at the same limit.
    conversation = Conversation(gateway.port)
    try:
        conversation.send(head("POST", path, "transfer-encoding: chunked", length=None))
        block = b"x" * 65536
        conversation.send_in_background([b"%x\r\n%s\r\n" % (len(block), block)] * (limit // len(block) + 2))
        answer = conversation.answer()
    finally:
        conversation.close()
    assert answer.status == 413


def test_a_client_s_root_path_header_moves_nothing(gateway: Gateway) -> None:
    """Daphne takes the scope's root path from a Daphne-Root-Path header: a client could route
    `/x/v1/messages` to the consumer past the key check at the headers, or make the router fail
    (a 500). The header is dropped."""
    answer = refused_before_the_body(gateway, head("POST", "/x/v1/messages", "daphne-root-path: /x"))
    assert answer.status == 413  # not an API path: no large body (and no consumer)
    answer = exchange(gateway, head("GET", "/v1/models", "Daphne-Root-Path: /elsewhere", length=None))
    assert answer.status == 401  # was a 500: no route for the path under that root


# --- ambiguous credentials ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        (["x-api-key: {wrong}", "x-api-key: {key}"], "The request has more than one x-api-key header: send one"),
        (["x-api-key: {key}", "x-api-key: {key}"], "The request has more than one x-api-key header: send one"),
        (["x-api-key: {key}", "authorization: Bearer {wrong}"], "x-api-key and Authorization: Bearer carry different keys: send one"),
        (["authorization: Bearer {wrong}", "x-api-key: {key}"], "x-api-key and Authorization: Bearer carry different keys: send one"),
        (["authorization: Bearer {key}", "authorization: Bearer {key}"], "The request has more than one Authorization header: send one"),
        (["authorization: Bearer \u00e9\u00ff"], "invalid x-api-key"),
        (["x-api-key: {key}\u00e9"], "invalid x-api-key"),
    ],
    ids=["two-keys", "two-same-keys", "key-and-other-bearer", "bearer-and-other-key", "two-authorizations", "non-ascii-bearer",
         "non-ascii-key"],
)
def test_ambiguous_or_malformed_credentials_are_refused(gateway: Gateway, key: str, headers: list[str], message: str) -> None:
    filled = [h.format(key=key, wrong=unknown_key()) for h in headers]
    answer = exchange(gateway, head("GET", "/v1/models", *filled, length=None))
    assert answer.status == 401
    assert answer.envelope() == {"type": "authentication_error", "message": message}


def test_the_same_key_in_both_headers_is_one_credential(gateway: Gateway, key: str) -> None:
    answer = exchange(gateway, head("GET", "/v1/models", f"x-api-key: {key}", f"authorization: Bearer {key}", length=None), wait_close=0)
    assert answer.status == 200


# --- /metrics ----------------------------------------------------------------------------------------


def non_loopback_address() -> str:
    """An address of this machine that is not loopback, or skip."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("203.0.113.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = str(probe.getsockname()[0])
    except OSError:
        pytest.skip("no network interface but loopback")
    finally:
        probe.close()
    if address.startswith("127."):
        pytest.skip("no network interface but loopback")
    return address


def get_metrics(gateway: Gateway, source: str, *headers: str) -> Answer:
    """GET /metrics from `source` (a local address: the socket's peer the gateway sees)."""
    data = ("\r\n".join(["GET /metrics HTTP/1.1", "host: 127.0.0.1", *headers]) + "\r\n\r\n").encode("latin-1")
    conversation = Conversation(gateway.port, host="127.0.0.1" if source.startswith("127.") else source, source=source)
    try:
        conversation.send(data)
        return conversation.answer(wait_close=0)
    finally:
        conversation.close()


@pytest.fixture(scope="module")
def proxied_gateway(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Gateway]:
    """daphne with --proxy-headers, on every interface: the scope's client is X-Forwarded-For's."""
    with django_db_blocker.unblock():
        with Gateway(host="0.0.0.0", daphne_args=["--proxy-headers"]) as gateway:
            yield gateway


@pytest.fixture(scope="module")
def any_interface_gateways(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Callable[..., Gateway]]:
    running: list[Gateway] = []

    def start(**env: str) -> Gateway:
        with django_db_blocker.unblock():
            running.append(Gateway(env, host="0.0.0.0").start())
        return running[-1]

    yield start
    for gateway in running:
        gateway.stop()


def test_metrics_loopback_is_the_socket_peer_not_a_forwarded_header(proxied_gateway: Gateway) -> None:
    outside = non_loopback_address()
    assert get_metrics(proxied_gateway, "127.0.0.1").status == 200
    # Before: X-Forwarded-For: 127.0.0.1 made any client loopback under --proxy-headers.
    for headers in (["x-forwarded-for: 127.0.0.1"], ["x-real-ip: 127.0.0.1"], []):
        answer = get_metrics(proxied_gateway, outside, *headers)
        assert answer.status == 403, headers
        assert answer.envelope()["type"] == "permission_error"
    # A loopback peer whose request came through a proxy is not a loopback client.
    answer = get_metrics(proxied_gateway, "127.0.0.1", "x-forwarded-for: 203.0.113.9")
    assert answer.status == 403


@pytest.mark.parametrize("variable", ["METRICS_TOKEN", "METRICS_BEARER_TOKEN"])
def test_metrics_with_a_token(any_interface_gateways: Callable[..., Gateway], variable: str) -> None:
    outside = non_loopback_address()
    token = secrets.token_urlsafe(24)
    gateway = any_interface_gateways(**{variable: token})
    # A token that is not ASCII was a 500 (hmac.compare_digest refuses non-ASCII strings).
    answer = get_metrics(gateway, "127.0.0.1", "authorization: Bearer \u00e9\u00ff")
    assert answer.status == 401 and answer.envelope()["type"] == "authentication_error"
    assert get_metrics(gateway, outside, f"authorization: Bearer {token}").status == 200
    assert get_metrics(gateway, outside, f"authorization: bearer {token}").status == 200
    for headers in ([], ["authorization: Bearer wrong"], ["authorization: Bearer \u00e9\u00ff"], [f"authorization: Basic {token}"],
                    [f"authorization: Bearer {token}", f"authorization: Bearer {token}"]):
        for source in (outside, "127.0.0.1"):  # with a token set, loopback needs it too
            answer = get_metrics(gateway, source, *headers)
            assert answer.status == 401, (headers, source, answer.body[:200])
            assert answer.envelope()["type"] == "authentication_error"


# --- the Cookie header -------------------------------------------------------------------------------


def test_a_cookie_header_over_the_cap_or_with_a_backslash_is_refused_before_django(gateway: Gateway) -> None:
    cap = settings.GATEWAY_MAX_COOKIE_BYTES
    at_cap = b'a="' + b"x" * (cap - 4) + b'"'
    assert len(at_cap) == cap
    for cookie, status in ((at_cap, 200), (b"a=1; b=" + b"x" * cap, 431), (b"sessionid=abc; csrftoken=def", 200)):
        answer = exchange(gateway, b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\ncookie: " + cookie + b"\r\n\r\n", wait_close=0)
        assert answer.status == status
        if status == 431:
            assert answer.envelope() == {
                "type": "request_too_large", "message": f"The Cookie header is larger than the limit of {cap} bytes",
            }
    # Several Cookie headers count together.
    half = b"a=" + b"x" * (cap // 2)
    answer = exchange(gateway, b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\ncookie: " + half + b"\r\ncookie: " + half + b"\r\n\r\n")
    assert answer.status == 431
    # Quoted and full of backslashes, Python 3.11's cookie parser is quadratic (CVE-2024-7592): no
    # cookie may hold a backslash (RFC 6265), and none reaches Django.
    worst = b'a="' + b"\\\\" * 1000 + b'"'
    answer = exchange(gateway, b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\ncookie: " + worst + b"\r\n\r\n")
    assert answer.status == 400
    assert answer.envelope() == {"type": "invalid_request_error", "message": "The Cookie header has a backslash, which no cookie may contain"}
