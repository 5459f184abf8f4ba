"""The error table and the one mapping from any exception to Anthropic's answer (pure)."""

from __future__ import annotations

import pytest

from messages_api.errors import (
    ERROR_TYPE_BY_STATUS,
    STATUS_BY_ERROR_TYPE,
    AnthropicError,
    DeadlineExceeded,
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
