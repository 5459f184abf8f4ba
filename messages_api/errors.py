"""Anthropic's errors: the envelope, the status <-> type table, and the one mapping from anything
that can go wrong while serving a request to the answer the client gets.

    {"type": "error", "error": {"type": ..., "message": ...}, "request_id": "req_..."}

Each kind of front-door error is a class raised by name, its status and type class attributes:
`InvalidRequest` (400), `AuthenticationFailed` (401), `PermissionDenied` (403), `NotFound` (404),
`MethodNotAllowed` (405), `RequestTooLarge` (413), `RateLimited` (429), `ApiInternalError` (500),
`ServiceUnavailable` (503), `GatewayTimeout` (504), `Overloaded` (529). Statuses 429, 503 and 529
carry `retry_after` (1 s unless given).

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

    Raised anywhere in `messages_api`, by the name of its kind (`NotFound("model: x")`, below);
    the consumer answers it as an HTTP error before the stream starts, or as an `event: error`
    after, with the same type and message. `AnthropicError(status, message, error_type)` makes
    one whose status is known only when it is made (a worker's failure, an error event).
    """

    status: int = 500
    error_type: str = "api_error"

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        *,
        retry_after: float | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.status = status
        self.error_type = error_type or error_type_for_status(status)
        self._describe(message, retry_after, headers)

    def _describe(self, message: str, retry_after: float | None, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        Exception.__init__(self, message)
        self.message = message
        if retry_after is None and self.status in RETRY_AFTER_STATUSES:
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
        return f"{type(self).__name__}({self.status}, {self.error_type!r}, {self.message!r})"


class _Kind(AnthropicError):
    """An error whose status and type are its class's: made from its message alone."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self._describe(message, retry_after, headers)


class InvalidRequest(_Kind):
    """400: the request is malformed or asks for what cannot be given."""

    status = 400
    error_type = "invalid_request_error"


class AuthenticationFailed(_Kind):
    """401: no API key, an unknown one, or one revoked."""

    status = 401
    error_type = "authentication_error"


class PermissionDenied(_Kind):
    """403: the key may not do this."""

    status = 403
    error_type = "permission_error"


class NotFound(_Kind):
    """404: no such resource (a model the key may not use is as unknown to it as a missing one)."""

    status = 404
    error_type = "not_found_error"


class MethodNotAllowed(_Kind):
    """405: the route does not serve this method (its `allow` header goes in `headers`)."""

    status = 405
    error_type = "invalid_request_error"


class RequestTooLarge(_Kind):
    """413: the body, or what it holds, is over a limit."""

    status = 413
    error_type = "request_too_large"


class RateLimited(_Kind):
    """429: over one of the key's limits (or a worker's); comes back after `retry_after`."""

    status = 429
    error_type = "rate_limit_error"


class ApiInternalError(_Kind):
    """500: the gateway or a worker failed; nothing the client did."""

    status = 500
    error_type = "api_error"


class ServiceUnavailable(_Kind):
    """503: a worker said it is overloaded, with this status."""

    status = 503
    error_type = "overloaded_error"


class GatewayTimeout(_Kind):
    """504: the answer took longer than a deadline allows."""

    status = 504
    error_type = "timeout_error"


class Overloaded(_Kind):
    """529: the cluster (or this process) has no room now; comes back after `retry_after`."""

    status = 529
    error_type = "overloaded_error"


class DeadlineExceeded(GatewayTimeout):
    """The request outlived MESSAGES_REQUEST_DEADLINE_S (arrival to last byte)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"Request timed out: it exceeded the deadline of {seconds:g} seconds")


def error_body(error_type: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def from_error_event(event: dict[str, Any]) -> AnthropicError:
    """An `error` stream event back as the `AnthropicError` it was made from."""
    error = event.get("error") or {}
    error_type = error.get("type") or "api_error"
    message = error.get("message") or INTERNAL_ERROR_MESSAGE
    return AnthropicError(STATUS_BY_ERROR_TYPE.get(error_type, 500), message, error_type)


def from_worker_error(exc: WorkerError) -> AnthropicError:
    """A cluster failure as Anthropic's answer (status, type, the worker's scrubbed message)."""
    if isinstance(exc, ContextLengthExceeded):
        return InvalidRequest(_context_length_message(exc))
    if isinstance(exc, OutputLimitExceeded):
        # Anthropic's wording for a max_tokens the model cannot give.
        return InvalidRequest(
            f"max_tokens: {exc.output_tokens} > {exc.max_context_tokens}, which is the maximum allowed number of "
            "output tokens for this model"
        )
    if isinstance(exc, NoEndpointAvailable):
        return Overloaded("Overloaded: " + exc.message, retry_after=exc.retry_after)
    status = exc.status
    if status in (400, 413, 422):
        return InvalidRequest(exc.message)
    if status == 429:
        return RateLimited(exc.message, retry_after=exc.retry_after)
    if status in (503, 529):
        return (ServiceUnavailable if status == 503 else Overloaded)(exc.message, retry_after=exc.retry_after)
    if status == 504:
        return GatewayTimeout(exc.message)
    if 500 <= status < 600:
        return AnthropicError(status, exc.message, "api_error")
    # A worker's 401/403/404/… is the gateway's misconfiguration, not the client's fault.
    return ApiInternalError(f"the {exc.stage} worker rejected the request with status {status}")


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
    return ApiInternalError(INTERNAL_ERROR_MESSAGE)


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
