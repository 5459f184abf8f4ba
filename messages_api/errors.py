"""Anthropic's errors: the envelope, the status <-> type table, and the one mapping from anything
that can go wrong while serving a request to the answer the client gets.

    {"type": "error", "error": {"type": ..., "message": ...}, "request_id": "req_..."}

`client_error(exc)` is the only place an exception becomes an `AnthropicError`: a worker failure
(`WorkerError`), one of ours (`AnthropicError`), the request's deadline, or a bug. The consumer
answers the result as an HTTP error before the stream starts and as an `error` event after, so a
late failure carries exactly the message its HTTP error would have.
"""

from __future__ import annotations

from typing import Any

from workers import ContextLengthExceeded, NoEndpointAvailable, OutputLimitExceeded, WorkerError

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

# The inverse, for an error that arrives as an event (which carries only a type): overloaded_error
# is 529, as the real API answers it, not the 503 that also maps to it.
STATUS_BY_ERROR_TYPE: dict[str, int] = {
    **{error_type: status for status, error_type in ERROR_TYPE_BY_STATUS.items() if status != 503},
    "overloaded_error": 529,
}

# Statuses whose clients should come back later: they carry `retry-after` (seconds).
RETRY_AFTER_STATUSES = frozenset({429, 503, 529})

INTERNAL_ERROR_MESSAGE = "Internal server error"


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
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or error_type_for_status(status)
        if retry_after is None and status in RETRY_AFTER_STATUSES:
            retry_after = 1.0
        self.retry_after = retry_after
        self.headers = headers

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (its attributes, not its constructor's arguments): a large body's
        # validation runs in a process of its own and raises these across (messages_api.intake).
        return (_rebuilt, (type(self), dict(self.__dict__)))

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        return error_body(self.error_type, self.message, request_id)

    def event(self) -> dict[str, Any]:
        """The stream form: an `error` event (SSE carries the request id in its headers)."""
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}

    def __repr__(self) -> str:
        return f"AnthropicError({self.status}, {self.error_type!r}, {self.message!r})"


class DeadlineExceeded(AnthropicError):
    """The request outlived MESSAGES_REQUEST_DEADLINE_S (arrival to last byte)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(504, f"Request timed out: it exceeded the deadline of {seconds:g} seconds", "timeout_error")


def error_body(error_type: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def invalid_request(message: str) -> AnthropicError:
    return AnthropicError(400, message, "invalid_request_error")


def from_error_event(event: dict[str, Any]) -> AnthropicError:
    """An `error` stream event back as the `AnthropicError` it was made from."""
    error = event.get("error") or {}
    error_type = error.get("type") or "api_error"
    message = error.get("message") or INTERNAL_ERROR_MESSAGE
    return AnthropicError(STATUS_BY_ERROR_TYPE.get(error_type, 500), message, error_type)


def from_worker_error(exc: WorkerError) -> AnthropicError:
    """A cluster failure as Anthropic's answer (status, type, the worker's scrubbed message)."""
    if isinstance(exc, ContextLengthExceeded):
        return AnthropicError(400, _context_length_message(exc), "invalid_request_error")
    if isinstance(exc, OutputLimitExceeded):
        # Anthropic's wording for a max_tokens the model cannot give.
        return AnthropicError(
            400,
            f"max_tokens: {exc.output_tokens} > {exc.max_context_tokens}, which is the maximum allowed number of "
            "output tokens for this model",
            "invalid_request_error",
        )
    if isinstance(exc, NoEndpointAvailable):
        return AnthropicError(529, "Overloaded: " + exc.message, "overloaded_error", retry_after=exc.retry_after)
    status = exc.status
    if status in (400, 413, 422):
        return AnthropicError(400, exc.message, "invalid_request_error")
    if status == 429:
        return AnthropicError(429, exc.message, "rate_limit_error", retry_after=exc.retry_after)
    if status in (503, 529):
        return AnthropicError(status, exc.message, "overloaded_error", retry_after=exc.retry_after)
    if status == 504:
        return AnthropicError(504, exc.message, "timeout_error")
    if 500 <= status < 600:
        return AnthropicError(status, exc.message, "api_error")
    # A worker's 401/403/404/… is the gateway's misconfiguration, not the client's fault.
    return AnthropicError(500, f"the {exc.stage} worker rejected the request with status {status}", "api_error")


def _context_length_message(exc: ContextLengthExceeded) -> str:
    """Anthropic's two wordings, which Claude Code acts on: "prompt is too long: …" makes it
    compact the conversation; "input length and `max_tokens` exceed context limit: P + T > M"
    makes it retry with a smaller max_tokens (the prompt alone fits)."""
    if exc.prompt_fits:
        return (
            f"input length and `max_tokens` exceed context limit: {exc.prompt_tokens} + {exc.output_tokens} > "
            f"{exc.max_context_tokens}, decrease input length or `max_tokens` and try again"
        )
    if exc.prompt_tokens is not None and exc.max_context_tokens is not None:
        return f"prompt is too long: {exc.prompt_tokens} tokens > {exc.max_context_tokens} maximum"
    # The worker gave no counts (a bare context_length_exceeded code): the wording still starts
    # as Claude Code matches it.
    window = f" of {exc.max_context_tokens} tokens" if exc.max_context_tokens is not None else ""
    return f"prompt is too long: it does not fit the model's context window{window}"


def client_error(exc: BaseException) -> AnthropicError:
    """What the client is told about `exc`. Anything unexpected is a bug: a bare 500 that names
    nothing inside the gateway (the traceback goes to the log)."""
    if isinstance(exc, AnthropicError):
        return exc
    if isinstance(exc, WorkerError):
        return from_worker_error(exc)
    return AnthropicError(500, INTERNAL_ERROR_MESSAGE, "api_error")


def operator_detail(exc: BaseException, error: AnthropicError) -> str:
    """What the audit row keeps about `exc`: the worker's redacted full text when it carries one
    (`WorkerError.detail`), the exception's class for a bug, else what the client was told."""
    detail = getattr(exc, "detail", None)
    if isinstance(detail, str) and detail:
        return detail
    if not isinstance(exc, (AnthropicError, WorkerError)):
        return f"{error.message} ({type(exc).__name__})"
    return error.message


def _rebuilt(cls: type[AnthropicError], state: dict[str, Any]) -> AnthropicError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("message", ""))
    error.__dict__.update(state)
    return error
