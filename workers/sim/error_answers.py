"""Errors the simulated worker answers with, all in vLLM's error envelope.

    SimError                an error status with `{"error": {message, type, param, code}}`
    SimulatedDrop           not an answer: the connection is cut mid-response (a fault)
"""

from __future__ import annotations

from http import HTTPStatus

import orjson

# vLLM's `error.type` by status (vllm/entrypoints/serve/exception_handling/error_response.py):
# the exception class it raised; any other status gets its HTTP phrase.
_VLLM_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type_for(status: int) -> str:
    """`error.type` for a status, the way vLLM words it."""
    return _VLLM_ERROR_TYPES.get(status) or status_phrase(status)


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"Error {status}"


class SimError(Exception):
    """Raised to answer the current request with an error status (before any response bytes).

    The body is vLLM's `{"error": {message, type, param, code}}`, `code` the HTTP status unless
    a sim-only error names its own."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code if code is not None else status

    @classmethod
    def simulated(cls, status: int) -> SimError:
        """The answer to a `context_status=`/`gen_status=` fault."""
        return cls(status, f"{status_phrase(status)} (simulated)")

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


def context_length_exceeded(max_context: int, prompt_tokens: int) -> SimError:
    """vLLM's over-length rejection, word for word (vllm/renderers/params.py `_token_len_check`).

    vLLM tokenizes a chat prompt only up to one token past the window, so for a longer prompt it
    can only say "at least max + 1": so does the sim.
    """
    count = min(prompt_tokens, max_context + 1)
    qualifier = "at least " if count == max_context + 1 else ""
    return SimError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, your prompt "
        f"contains {qualifier}{count} input tokens, which exceeds this limit even without any "
        f"output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={count})",
        param="input_tokens",
    )


class SimulatedDrop(Exception):
    """Raised to cut the connection abruptly mid-response (the `gen_fail_after=` fault).

    It propagates out of the ASGI app on purpose: uvicorn then closes the transport without
    finishing the chunked body, which is what a crashed worker looks like to its client.
    """
