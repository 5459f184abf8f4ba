"""The one mapping from a cluster failure to Anthropic's answer.

The consumer uses it for an HTTP error before the stream starts and for the `error` event after,
so a late failure carries exactly the message its HTTP error would have.
"""

from __future__ import annotations

from messages_api.errors import AnthropicError
from workers.errors import ContextLengthExceeded, NoEndpointAvailable, WorkerError


def anthropic_error(exc: WorkerError) -> AnthropicError:
    if isinstance(exc, ContextLengthExceeded):
        # Claude Code matches this wording to compact its context (reference/anthropic_api.md §1).
        return AnthropicError(
            400,
            f"prompt is too long: {exc.prompt_tokens} tokens > {exc.max_context_tokens} maximum",
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
