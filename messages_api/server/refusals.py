"""The HTTP intake guard's decisions, without Twisted (messages_api/server/http_guard.py adapts
Twisted's parser to them): which refusal each event of the parser earns, the bytes that answer
it, daphne's own error page in Anthropic's envelope, and what an unauthenticated refusal leaves
in the audit.

A refusal is header_gate's `Refusal` (status, message, Anthropic's error type, whether the request
had no valid API key), the verdict `header_gate.check()` also returns. Statuses and types:

- a body over the limit: Anthropic's documented 413 `request_too_large`;
- a header section too large: 431 (RFC 6585; Anthropic has no status for it) with
  `request_too_large`, Anthropic's type for a request over a byte limit;
- a request not received in time: HTTP's 408 with `timeout_error` (the SDKs retry 408);
- malformed HTTP: 400 `invalid_request_error`;
- an API key the lookup found invalid: 401 `authentication_error`, unauthenticated.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import orjson

from messages_api.audit import AuditRecord, new_request_id, sample_anonymous
from messages_api.auth import INVALID_KEY, KeyLookupOverloaded, Principal
from messages_api.errors import error_body, error_type_for_status
from messages_api.models import RequestStatus
from messages_api.server.header_gate import Refusal, scope_path

__all__ = [
    "body_too_large",
    "declared_length_refusal",
    "error_page",
    "key_lookup_refusal",
    "line_too_long",
    "parse_failure",
    "read_timed_out",
    "record_unauthenticated",
    "refusal_bytes",
    "route_of",
    "TOO_LARGE",
]

# Anthropic's type for a request over a byte limit, also for the header section's 431.
TOO_LARGE = "request_too_large"


# --- which refusal ------------------------------------------------------------------------------


def body_too_large(limit: int) -> Refusal:
    """A body (declared, or counted as a chunked one is decoded) over `limit` bytes."""
    return Refusal(413, f"Request body is larger than the limit of {limit} bytes", TOO_LARGE)


def declared_length_refusal(length: int | None, limit: int) -> Refusal | None:
    """A declared Content-Length (None: chunked, counted later) over `limit`: refused once the
    headers are in, before a byte of the body is read."""
    if length is not None and length > limit:
        return body_too_large(limit)
    return None


def line_too_long(max_length: int) -> Refusal:
    """A request line or header line over Twisted's `MAX_LENGTH`."""
    return Refusal(431, f"A request line or header is longer than the limit of {max_length} bytes", TOO_LARGE)


def parse_failure(
    *, header_bytes: int, header_bytes_limit: int, header_count: int, header_count_limit: int, in_headers: bool
) -> Refusal:
    """What Twisted's one parse failure (`_respondToBadRequestAndDisconnect`) was, from its
    counters: the header section over its size or count limit (431), a malformed chunked body
    (`in_headers` False: Twisted was decoding the body), or a malformed request line or header."""
    if header_bytes > header_bytes_limit:
        return Refusal(431, f"The request line and headers are larger than the limit of {header_bytes_limit} bytes", TOO_LARGE)
    if header_count > header_count_limit:
        return Refusal(431, f"The request has more than the limit of {header_count_limit} headers", TOO_LARGE)
    if not in_headers:
        return Refusal(400, "The request body's chunked encoding is malformed", error_type_for_status(400))
    return Refusal(400, "The request line or headers are malformed", error_type_for_status(400))


def read_timed_out(seconds: float) -> Refusal:
    """The request line, headers and body did not arrive within `seconds` of its first byte."""
    return Refusal(408, f"The request was not received within {seconds:g} seconds", "timeout_error")


def key_lookup_refusal(lookup: asyncio.Future[Principal | None]) -> Refusal | None:
    """The verdict of a finished key lookup: 401 when it found no valid key, 529 when it got no
    turn (`KeyLookupOverloaded`); None (go on) for a key, and for a lookup that failed otherwise
    or was cancelled (the consumer looks again and answers)."""
    if lookup.cancelled():
        return None
    exc = lookup.exception()
    if isinstance(exc, KeyLookupOverloaded):
        return Refusal(exc.status, exc.message, exc.error_type, unauthenticated=True, retry_after=1)
    if exc is None and lookup.result() is None:
        return Refusal(401, INVALID_KEY, "authentication_error", unauthenticated=True)
    return None


# --- the answer ---------------------------------------------------------------------------------


def refusal_bytes(refusal: Refusal, request_id: str | None = None) -> bytes:
    """A complete HTTP/1.1 answer in Anthropic's envelope that closes the connection."""
    request_id = request_id or new_request_id()
    body = orjson.dumps(error_body(refusal.error_type, refusal.message, request_id))
    head = (
        f"HTTP/1.1 {refusal.status} {_phrase(refusal.status)}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"request-id: {request_id}\r\n"
        + (f"retry-after: {refusal.retry_after}\r\n" if refusal.retry_after is not None else "")
        + "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # 529 is Anthropic's (overloaded), not HTTP's: HTTPStatus has no phrase for it
        return "Overloaded"


def error_page(status: int, reason: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Daphne's HTML error page (`WebRequest.basic_error`) as the two ASGI messages of an answer in
    Anthropic's envelope; `reason` is daphne's one-line reason, never a traceback."""
    request_id = new_request_id()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"request-id", request_id.encode())],
    }
    body = {"type": "http.response.body", "body": orjson.dumps(error_body(error_type_for_status(status), reason, request_id))}
    return start, body


# --- what a refusal leaves behind ---------------------------------------------------------------


def route_of(method: bytes, target: bytes) -> str:
    """The audit row's route ("POST /v1/messages") of a request refused before daphne saw it."""
    return f"{method.decode('ascii', 'replace')} {scope_path(target) or '?'}"


def record_unauthenticated(refusal: Refusal, method: bytes, target: bytes) -> str:
    """End the audit record of a request refused for its API key, as the consumers do: counted
    always, its row (and access log line) only sampled (AUDIT_UNAUTHENTICATED_SAMPLE_PER_S). The
    record's request id, which the answer carries."""
    record = AuditRecord(route=route_of(method, target))
    detail = sample_anonymous(refusal.message)
    record.end(
        RequestStatus.REJECTED,
        http_status=refusal.status,
        error_type=refusal.error_type,
        error_message=detail or refusal.message,
        persist=detail is not None,
    )
    return record.request_id

