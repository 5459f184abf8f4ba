"""The error table and the one mapping from any exception to Anthropic's answer (pure)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from messages_api.errors import (
    ERROR_TYPE_BY_STATUS,
    STATUS_BY_ERROR_TYPE,
    AnthropicError,
    ApiInternalError,
    AuthenticationFailed,
    DeadlineExceeded,
    GatewayTimeout,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PermissionDenied,
    RateLimited,
    RequestTooLarge,
    ServiceUnavailable,
    client_error,
    from_error_event,
    operator_detail,
)
from workers.exceptions import ContextLengthExceeded, NoEndpointAvailable, StreamBroken, WorkerError


def test_every_error_type_maps_back_to_a_status_of_its_own_type() -> None:
    assert set(STATUS_BY_ERROR_TYPE) == set(ERROR_TYPE_BY_STATUS.values())
    for error_type, status in STATUS_BY_ERROR_TYPE.items():
        assert ERROR_TYPE_BY_STATUS[status] == error_type
    assert STATUS_BY_ERROR_TYPE["overloaded_error"] == 529  # as the real API answers it


@pytest.mark.parametrize("error_type,status", sorted(STATUS_BY_ERROR_TYPE.items()))
def test_an_error_event_round_trips(error_type: str, status: int) -> None:
    error = AnthropicError(status, "the message")
    again = from_error_event(error.event())
    assert (again.status, again.error_type, again.message) == (status, error_type, "the message")


@pytest.mark.parametrize(
    "exc,status,error_type",
    [
        (WorkerError(400, "bad", stage="context"), 400, "invalid_request_error"),
        (WorkerError(422, "bad", stage="context"), 400, "invalid_request_error"),
        (WorkerError(429, "slow down", stage="context", retry_after=3), 429, "rate_limit_error"),
        (WorkerError(503, "busy", stage="generation"), 503, "overloaded_error"),
        (WorkerError(504, "late", stage="generation"), 504, "timeout_error"),
        (WorkerError(500, "boom", stage="generation"), 500, "api_error"),
        (StreamBroken(502, "malformed chunk", stage="generation"), 502, "api_error"),
        (WorkerError(404, "no route", stage="context"), 500, "api_error"),
        (NoEndpointAvailable(503, "no generation endpoint", stage="generation", retry_after=2), 529, "overloaded_error"),
    ],
)
def test_worker_errors_map_to_anthropic_statuses(exc: WorkerError, status: int, error_type: str) -> None:
    error = client_error(exc)
    assert (error.status, error.error_type) == (status, error_type)
    if status in (429, 529):
        assert error.retry_after == exc.retry_after


def test_context_length_keeps_the_wording_claude_code_matches() -> None:
    exc = ContextLengthExceeded("too long", stage="context", prompt_tokens=5000, max_context_tokens=4096)
    assert client_error(exc).message == "prompt is too long: 5000 tokens > 4096 maximum"


def test_a_bug_is_a_bare_500_and_the_operator_sees_its_class() -> None:
    exc = KeyError("choices")
    error = client_error(exc)
    assert (error.status, error.error_type, error.message) == (500, "api_error", "Internal server error")
    assert operator_detail(exc, error) == "Internal server error (KeyError)"


def test_ours_are_answered_as_they_are() -> None:
    error = DeadlineExceeded(1.5)
    assert client_error(error) is error
    assert (error.status, error.error_type) == (504, "timeout_error") and "1.5 seconds" in error.message


def test_the_audit_keeps_a_workers_redacted_detail() -> None:
    exc = WorkerError(500, "engine failed", stage="generation")
    assert operator_detail(exc, client_error(exc)) == "engine failed"
    exc.detail = "engine failed: CUDA error at [path]"  # type: ignore[attr-defined]
    assert operator_detail(exc, client_error(exc)) == "engine failed: CUDA error at [path]"


KINDS = [
    (InvalidRequest, 400, "invalid_request_error"),
    (AuthenticationFailed, 401, "authentication_error"),
    (PermissionDenied, 403, "permission_error"),
    (NotFound, 404, "not_found_error"),
    (MethodNotAllowed, 405, "invalid_request_error"),
    (RequestTooLarge, 413, "request_too_large"),
    (RateLimited, 429, "rate_limit_error"),
    (ApiInternalError, 500, "api_error"),
    (ServiceUnavailable, 503, "overloaded_error"),
    (GatewayTimeout, 504, "timeout_error"),
    (Overloaded, 529, "overloaded_error"),
]


@pytest.mark.parametrize("kind,status,error_type", KINDS)
def test_each_kind_carries_its_status_and_type(kind: Any, status: int, error_type: str) -> None:
    assert (kind.status, kind.error_type) == (status, error_type)  # on the class: readable unraised
    error = kind("the message")  # a kind is made from its message alone
    assert isinstance(error, AnthropicError)
    assert (error.status, error.error_type, error.message, str(error)) == (status, error_type, "the message", "the message")
    # The same answer as the generic form made with the status and type.
    generic = AnthropicError(status, "the message", error_type)
    assert error.body("req_1") == generic.body("req_1") == {
        "type": "error", "error": {"type": error_type, "message": "the message"}, "request_id": "req_1",
    }
    assert error.event() == generic.event()
    assert error.retry_after == generic.retry_after
    assert client_error(error) is error


@pytest.mark.parametrize("kind,status,error_type", KINDS)
def test_a_kind_comes_back_later_exactly_when_its_status_says_so(kind: Any, status: int, error_type: str) -> None:
    error = kind("the message")
    assert error.retry_after == (1.0 if status in (429, 503, 529) else None)
    waited = kind("the message", retry_after=7.0, headers=((b"x-h", b"v"),))
    assert (waited.retry_after, waited.headers) == (7.0, ((b"x-h", b"v"),))


def test_a_kind_survives_pickling_whole() -> None:
    """A large body's validation raises across a process (messages_api.intake)."""
    error = RateLimited("slow down", retry_after=3.0, headers=((b"x-h", b"v"),))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is RateLimited
    assert (again.status, again.error_type, again.message, again.retry_after, again.headers) == (
        429, "rate_limit_error", "slow down", 3.0, ((b"x-h", b"v"),)
    )
    assert repr(again) == "RateLimited(429, 'rate_limit_error', 'slow down')"


def test_worker_failures_map_to_the_kinds() -> None:
    assert type(client_error(WorkerError(429, "slow", stage="context"))) is RateLimited
    assert type(client_error(WorkerError(503, "busy", stage="context"))) is ServiceUnavailable
    assert type(client_error(KeyError("x"))) is ApiInternalError
    assert isinstance(DeadlineExceeded(1.0), GatewayTimeout)
