"""Anthropic's error envelope and status table: the one place an error gets its type.

    {"type": "error", "error": {"type": ..., "message": ...}, "request_id": "req_..."}
"""

from __future__ import annotations

from typing import Any

# Anthropic's table (docs: api/errors). A status not listed maps by class: 4xx → invalid request,
# 5xx → api_error.
ERROR_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

# Statuses whose clients should come back later: they carry `retry-after` (seconds).
RETRY_AFTER_STATUSES = frozenset({429, 503, 529})


def error_type_for_status(status: int) -> str:
    if status in ERROR_TYPE_BY_STATUS:
        return ERROR_TYPE_BY_STATUS[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


class AnthropicError(Exception):
    """An error to answer in Anthropic's envelope, with its HTTP status.

    Raised anywhere in `messages_api`; the consumer answers it as an HTTP error before the stream
    starts, or as an `event: error` after, with the same type and message.
    """

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or error_type_for_status(status)
        if retry_after is None and status in RETRY_AFTER_STATUSES:
            retry_after = 1.0
        self.retry_after = retry_after

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        return error_body(self.error_type, self.message, request_id)

    def event(self) -> dict[str, Any]:
        """The stream form: an `error` event (SSE carries the request id in its headers)."""
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}

    def __repr__(self) -> str:
        return f"AnthropicError({self.status}, {self.error_type!r}, {self.message!r})"


def error_body(error_type: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def invalid_request(message: str) -> AnthropicError:
    return AnthropicError(400, message, "invalid_request_error")
