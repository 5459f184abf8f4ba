"""What can go wrong in the cluster, as values the front door maps to its own protocol.

`workers` knows nothing of Anthropic: a `WorkerError` carries the worker's HTTP status, a message
a client may read (the engine's own words, scrubbed of addresses, paths, tracebacks and
secrets: `workers.wire.redact`), the stage it happened in, a machine-readable code, and `detail`, the
fuller text an operator reads in the audit row (secrets masked).

    WorkerError
    ├── WorkerUnreachable        503  no answer: refused, reset, bare 502/503 from a proxy
    ├── WorkerTimeout            504  a deadline passed (context phase, first byte, idle, total)
    ├── MalformedAnswer          502  the answer is not what the engines document
    │   └── AnswerTooLarge       502  ... or is larger than the gateway reads
    ├── StreamBroken             502  the generation stream failed after it opened
    │   ├── StreamTimedOut       504  ... went silent (also a WorkerTimeout)
    │   └── MalformedChunk       502  ... sent a malformed or oversized chunk (also a MalformedAnswer)
    ├── NoEndpointAvailable           no enabled, healthy endpoint of a needed role
    ├── ContextLengthExceeded    400  the prompt (or prompt + output) does not fit the context window
    └── OutputLimitExceeded      400  the requested output alone is larger than the context window

The worker client (`workers.wire.client`, `workers.wire.chat_stream`) raises all but
`NoEndpointAvailable` (the router's), from one place (`workers.wire.boundary`); a worker's error
answer is read in `workers.wire.error_reading`.

`StopRelay` is not a failure: a relay's sink raises it to end the answer early (`ChatRun.relay`).
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
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.stage = stage
        self.code = code
        self.retry_after = retry_after
        # For the audit row: what the worker said, secrets masked, addresses and paths kept.
        self.detail = detail if detail is not None else message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, stage={self.stage!r}, code={self.code!r})"


class WorkerUnreachable(WorkerError):
    """The connection failed before the worker answered (refused, reset, timed out connecting)."""


class WorkerTimeout(WorkerError):
    """A worker call passed one of its deadlines (`WORKER_*_TIMEOUT_S`); status 504, code "timeout"."""


class MalformedAnswer(WorkerError):
    """The worker answered something other than the documented OpenAI chat shape; status 502."""


class AnswerTooLarge(MalformedAnswer):
    """The answer, or one line of its stream, is larger than the gateway will read."""


class StreamBroken(WorkerError):
    """The generation stream failed after it opened (ended before `[DONE]`, or see subclasses)."""


class StreamTimedOut(StreamBroken, WorkerTimeout):
    """The generation stream was silent longer than its idle deadline, or outlived its total one."""


class MalformedChunk(StreamBroken, MalformedAnswer):
    """A chunk of the generation stream is malformed or too large."""


class NoEndpointAvailable(WorkerError):
    """No enabled, healthy, non-draining endpoint of a role the request needs."""


class ContextLengthExceeded(WorkerError):
    """The prompt, or the prompt with the output tokens requested, is longer than the worker's
    context window.

    The counts are the worker's own when its wording gives them, else None (a bare
    `context_length_exceeded` code): `prompt_tokens` (everything the window holds before the
    output), `max_context_tokens` (the window), `output_tokens` (the output counted against the
    window, when the worker counted one: then the prompt alone may fit).
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        prompt_tokens: int | None,
        max_context_tokens: int | None,
        output_tokens: int | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(400, message, stage=stage, code="context_length_exceeded", detail=detail)
        self.prompt_tokens = prompt_tokens
        self.max_context_tokens = max_context_tokens
        self.output_tokens = output_tokens

    @property
    def prompt_fits(self) -> bool:
        """Whether the prompt alone fits: only the output requested on top of it does not."""
        return (
            self.prompt_tokens is not None
            and self.max_context_tokens is not None
            and self.output_tokens is not None
            and self.prompt_tokens < self.max_context_tokens
        )


class OutputLimitExceeded(WorkerError):
    """The output tokens requested (`max_tokens`) are more than the worker's context window holds,
    whatever the prompt: a bad request, not an over-length prompt (shortening it cannot help)."""

    def __init__(self, message: str, *, stage: str, output_tokens: int, max_context_tokens: int, detail: str | None = None) -> None:
        super().__init__(400, message, stage=stage, code="max_tokens_exceeded", detail=detail)
        self.output_tokens = output_tokens
        self.max_context_tokens = max_context_tokens


class StopRelay(Exception):
    """Raised by a relay's sink (`ChatRun.relay`) that takes no more of the answer (the front
    door's output limit): the answer ends there as complete, nothing more is read from the
    worker, and its request is cancelled (its connection closed, the rest unread)."""
