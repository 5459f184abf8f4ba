"""A worker's error answer read as its `WorkerError`: the engine's message scrubbed for the client
(`workers.wire.redact`), the raw body logged, a redacted copy for the audit row; and a request
that does not fit the context window, or asks for more output than the window holds, told apart
from the rest, in the engine's own wording.

    error = worker_error(400, body, "generation", wordings=protocol.error_wordings)

Each engine's wordings are its dialect's (`WorkerProtocol.error_wordings`, in `workers.protocols`):
the caller passes those of the pool it asked. Whatever the engine, a sentence naming "maximum
context length is N tokens", or the code `context_length_exceeded`, is over-length too.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import orjson

from workers.exceptions import ContextLengthExceeded, OutputLimitExceeded, WorkerError, WorkerUnreachable
from workers.wire import redact

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Wording:
    """One engine's sentence for a request that does not fit: a pattern whose named groups are
    `maximum` the window, `prompt` the prompt's tokens, `query` tokens TensorRT-LLM counts beside
    the prompt, `output` the output tokens counted against the window (when present, the prompt
    alone may fit). `output_only`: the sentence says the output asked for is larger than the
    window whatever the prompt (not an over-length prompt: an `OutputLimitExceeded`). A count is
    at most 12 digits (`\\d{1,12}`): a worker's 5,000-digit number must not reach int() (which
    refuses over 4,300)."""

    pattern: re.Pattern[str]
    output_only: bool = False


def wording(pattern: str, *, output_only: bool = False) -> Wording:
    return Wording(re.compile(pattern, re.I), output_only)


Wordings = tuple[Wording, ...]

# Any engine's sentence naming the window (a wording not known): over-length, without a prompt count.
_MAX_CONTEXT = re.compile(r"maximum context length is (?P<maximum>\d{1,12}) tokens", re.I)


def _window_error(
    raw_message: str, code: str | None, message: str, stage: str, detail: str, wordings: Wordings
) -> WorkerError | None:
    """The over-length (or output-too-large) error a worker's message or code describes, with the
    counts read from the raw text (scrubbing must not hide them); None if it is another error."""
    for known in wordings:
        match = known.pattern.search(raw_message)
        if match is None:
            continue
        counts = match.groupdict()
        if known.output_only:
            return OutputLimitExceeded(
                message, stage=stage, output_tokens=int(counts["output"]), max_context_tokens=int(counts["maximum"]), detail=detail
            )
        return ContextLengthExceeded(
            message,
            stage=stage,
            prompt_tokens=int(counts["prompt"]) + int(counts.get("query") or 0),
            max_context_tokens=int(counts["maximum"]),
            output_tokens=int(counts["output"]) if counts.get("output") else None,
            detail=detail,
        )
    match = _MAX_CONTEXT.search(raw_message)
    if match or code == "context_length_exceeded":
        return ContextLengthExceeded(
            message, stage=stage, prompt_tokens=None, max_context_tokens=int(match["maximum"]) if match else None, detail=detail
        )
    return None


def _error_fields(body: bytes, status: int, stage: str) -> tuple[str, str | None, bool]:
    """The worker's raw message and code from an OpenAI, TensorRT-LLM or FastAPI error body, and
    whether the body held the message (False: the message is a generic one)."""
    message: str | None = None
    code: str | None = None
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            message, code = err.get("message"), err.get("code")
        elif isinstance(err, str):
            message = err
        elif isinstance(data.get("message"), str):
            message, code = data["message"], data.get("code")
        elif isinstance(data.get("detail"), str):
            message = data["detail"]
    parsed = bool(message)
    if not message:
        message = f"{stage} worker rejected the request with status {status}"
    return str(message), (str(code) if code is not None else None), parsed


def worker_error(
    status: int, body: bytes, stage: str, retry_after: float | None = None, *, wordings: Wordings = ()
) -> WorkerError:
    """The `WorkerError` for a worker's error answer: the client message scrubbed, the raw body
    logged, a redacted copy in `detail` for the audit row. `wordings`: the engine's sentences for
    a request that does not fit (its protocol's `error_wordings`)."""
    if status in (502, 503) and not body.strip():
        # A bare 502/503 comes from something in front of the worker (a proxy, a load balancer,
        # a server still starting), not from a worker that looked at the request: like a refused
        # connection, it may be retried elsewhere.
        return WorkerUnreachable(
            status, f"the {stage} worker answered {status} without a body", stage=stage, code="no_answer", retry_after=retry_after
        )
    raw_text = body.decode("utf-8", "replace")
    logger.warning("the %s worker answered %d: %s", stage, status, redact.log_text(raw_text))
    raw_message, code, parsed = _error_fields(body, status, stage)
    message = redact.client_text(raw_message) or f"the {stage} worker rejected the request with status {status}"
    # The engine's own message when the body had one (what an operator reads first), else the
    # body itself (a proxy's HTML page, a plain-text error).
    detail = redact.audit_text(raw_message if parsed or not raw_text.strip() else raw_text)
    if code is not None:
        code = redact.client_text(code, limit=64)
    # A 4xx is the request's fault, so its wording can say over-length; the code says it anywhere
    # (an error frame inside a stream carries no status of its own).
    if 400 <= status < 500 or code == "context_length_exceeded":
        window_error = _window_error(raw_message, code, message, stage, detail, wordings)
        if window_error is not None:
            return window_error
    return WorkerError(status, message, stage=stage, code=code, retry_after=retry_after, detail=detail)


__all__ = ["Wording", "wording", "Wordings", "worker_error"]
