"""What can go wrong in the cluster, as values the front door maps to its own protocol.

`workers` knows nothing of Anthropic: a `WorkerError` carries the worker's HTTP status, the
worker's message (never its address), the stage it happened in, and a machine-readable code.
"""

from __future__ import annotations


class WorkerError(Exception):
    """A worker (or the way to it) failed a request."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        stage: str,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.stage = stage
        self.code = code
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, stage={self.stage!r}, code={self.code!r})"


class WorkerUnreachable(WorkerError):
    """The connection failed before the worker answered (refused, reset, timed out connecting)."""


class StreamBroken(WorkerError):
    """The generation stream ended before `[DONE]` (connection dropped or garbage)."""


class NoEndpointAvailable(WorkerError):
    """No enabled, healthy, non-draining endpoint of a role the request needs."""


class ContextLengthExceeded(WorkerError):
    """The prompt is longer than the worker's context window."""

    def __init__(self, message: str, *, stage: str, prompt_tokens: int, max_context_tokens: int) -> None:
        super().__init__(400, message, stage=stage, code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.max_context_tokens = max_context_tokens
