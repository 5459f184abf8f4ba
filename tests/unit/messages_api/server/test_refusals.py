"""messages_api/server/refusals.py: the HTTP intake guard's decisions without Twisted. Which refusal
each parser event earns (status, message, Anthropic's type), the answer's bytes, daphne's error
page in the envelope, and the sampled audit row of an unauthenticated refusal. The guard carrying
them out on real sockets: tests/e2e/test_http_guard.py, test_header_gate.py."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from messages_api.audit import AuditRecord
from messages_api.auth import INVALID_KEY, KeyLookupOverloaded, Principal
from messages_api.models import RequestStatus
from messages_api.server import refusals
from messages_api.server.header_gate import Refusal


def test_a_declared_length_over_the_limit_is_a_413() -> None:
    assert refusals.declared_length_refusal(1001, 1000) == Refusal(
        413, "Request body is larger than the limit of 1000 bytes", "request_too_large"
    )
    assert refusals.declared_length_refusal(1000, 1000) is None
    assert refusals.declared_length_refusal(None, 1000) is None  # chunked: counted as decoded
    assert refusals.body_too_large(1000) == refusals.declared_length_refusal(1001, 1000)


def test_a_line_over_twisteds_limit_is_a_431() -> None:
    assert refusals.line_too_long(16384) == Refusal(
        431, "A request line or header is longer than the limit of 16384 bytes", "request_too_large"
    )


@pytest.mark.parametrize(
    ("counters", "expected"),
    [
        (
            {"header_bytes": 16385, "header_count": 501, "in_headers": True},
            Refusal(431, "The request line and headers are larger than the limit of 16384 bytes", "request_too_large"),
        ),
        (
            {"header_bytes": 100, "header_count": 501, "in_headers": True},
            Refusal(431, "The request has more than the limit of 500 headers", "request_too_large"),
        ),
        (
            {"header_bytes": 100, "header_count": 3, "in_headers": False},
            Refusal(400, "The request body's chunked encoding is malformed", "invalid_request_error"),
        ),
        (
            {"header_bytes": 100, "header_count": 3, "in_headers": True},
            Refusal(400, "The request line or headers are malformed", "invalid_request_error"),
        ),
    ],
    ids=["header-bytes-first", "header-count", "chunked-body", "request-line-or-header"],
)
def test_twisteds_one_parse_failure_is_told_apart_by_its_counters(counters: dict[str, Any], expected: Refusal) -> None:
    assert refusals.parse_failure(header_bytes_limit=16384, header_count_limit=500, **counters) == expected


def test_a_request_not_received_in_time_is_a_408_timeout_error() -> None:
    assert refusals.read_timed_out(1.5) == Refusal(408, "The request was not received within 1.5 seconds", "timeout_error")
    assert refusals.read_timed_out(30.0).message == "The request was not received within 30 seconds"


def finished(result: Principal | None = None, error: BaseException | None = None, cancel: bool = False) -> asyncio.Future[Principal | None]:
    """A key lookup that has ended: with `result`, with `error`, or cancelled."""
    lookup: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
    if cancel:
        lookup.cancel()
    elif error is not None:
        lookup.set_exception(error)
    else:
        lookup.set_result(result)
    return lookup


async def test_only_a_lookup_that_found_no_valid_key_is_refused() -> None:
    assert refusals.key_lookup_refusal(finished(None)) == Refusal(401, INVALID_KEY, "authentication_error", unauthenticated=True)
    principal = Principal(key_hash="h", name="k")
    assert refusals.key_lookup_refusal(finished(principal)) is None
    # A failed or cancelled lookup lets the request through: the consumer looks again.
    assert refusals.key_lookup_refusal(finished(error=RuntimeError("database down"))) is None
    assert refusals.key_lookup_refusal(finished(cancel=True)) is None


def test_the_answer_is_a_whole_http_response_in_the_envelope_that_closes() -> None:
    data = refusals.refusal_bytes(Refusal(413, "too big", "request_too_large"), "req_abc")
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("ascii").split("\r\n")
    assert lines[0] == "HTTP/1.1 413 Request Entity Too Large"
    assert set(lines[1:]) == {
        "content-type: application/json",
        f"content-length: {len(body)}",
        "request-id: req_abc",
        "connection: close",
    }
    assert orjson.loads(body) == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "too big"},
        "request_id": "req_abc",
    }
    fresh = refusals.refusal_bytes(Refusal(408, "late", "timeout_error"))
    assert b"request-id: req_" in fresh


def test_daphnes_error_page_becomes_the_envelope_with_one_request_id() -> None:
    start, body = refusals.error_page(500, "Application instance took too long to shut down and was killed.")
    headers = dict(start["headers"])
    assert (start["type"], start["status"], headers[b"content-type"]) == ("http.response.start", 500, b"application/json")
    envelope = orjson.loads(body["body"])
    assert body["type"] == "http.response.body"
    assert envelope["error"] == {"type": "api_error", "message": "Application instance took too long to shut down and was killed."}
    assert envelope["request_id"].encode() == headers[b"request-id"]


def test_the_route_of_a_refused_request_is_the_path_daphne_would_route() -> None:
    assert refusals.route_of(b"POST", b"/v1/%6dessages?beta=true") == "POST /v1/messages"
    assert refusals.route_of(b"GET", b"/v1/\x80") == "GET ?"  # daphne answers 400 for it itself


@pytest.mark.parametrize("sampled", [True, False])
def test_an_unauthenticated_refusal_ends_its_record_and_writes_its_row_only_when_sampled(
    sampled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[dict[str, Any]] = []
    monkeypatch.setattr(AuditRecord, "_write", lambda record, **_: rows.append(record.row()))
    monkeypatch.setattr(refusals, "sample_anonymous", lambda detail: f"{detail} (and 2 more)" if sampled else None)
    refusal = Refusal(401, INVALID_KEY, "authentication_error", unauthenticated=True)
    request_id = refusals.record_unauthenticated(refusal, b"POST", b"/v1/messages")
    assert request_id.startswith("req_")
    if not sampled:
        assert rows == []
        return
    [row] = rows
    assert (row["request_id"], row["route"], row["status"], row["http_status"]) == (
        request_id, "POST /v1/messages", RequestStatus.REJECTED, 401
    )
    assert (row["error_type"], row["error_message"]) == ("authentication_error", f"{INVALID_KEY} (and 2 more)")


async def test_a_lookup_that_got_no_turn_is_a_529_with_retry_after() -> None:
    overloaded = refusals.key_lookup_refusal(finished(error=KeyLookupOverloaded()))
    assert overloaded is not None and (overloaded.status, overloaded.error_type) == (529, "overloaded_error")
    assert overloaded.unauthenticated and overloaded.retry_after == 1
    head = refusals.refusal_bytes(overloaded, "req_x").split(b"\r\n\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 529 Overloaded\r\n") and b"\r\nretry-after: 1\r\n" in head
