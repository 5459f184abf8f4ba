"""Errors the simulated worker answers with, all in OpenAI's error envelope.

    SimError                an error status with `{"error": {message, type, param, code}}`
    SimulatedDrop           not an answer: the connection is cut mid-response (a fault)
"""

from __future__ import annotations

from http import HTTPStatus

import orjson


def error_type_for(status: int) -> str:
    """OpenAI-style `error.type` for a status, the way vLLM/TensorRT-LLM servers word it."""
    if status in (503, 529):
        return "overloaded"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"Error {status}"


class SimError(Exception):
    """Raised to answer the current request with an error status (before any response bytes)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code

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
    """vLLM's over-length rejection, word for word."""
    return SimError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, your messages "
        f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
        type="invalid_request_error",
        param="messages",
        code="context_length_exceeded",
    )


class SimulatedDrop(Exception):
    """Raised to cut the connection abruptly mid-response (the `gen_fail_after=` fault).

    It propagates out of the ASGI app on purpose: uvicorn then closes the transport without
    finishing the chunked body, which is what a crashed worker looks like to its client.
    """
