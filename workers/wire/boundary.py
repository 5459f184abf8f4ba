"""The error boundary of every worker call: whatever fails inside it (a transport error, a passed
deadline, an answer malformed, too large or of the wrong shape) leaves as its `WorkerError`
(workers.exceptions), with a client message that never names the worker's address and a
description for the audit row that does.

    with boundary("context"):                      # a call, up to its answer
        ...
    with boundary("generation", streaming=True):   # the open stream: failures are StreamBroken
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import orjson

from workers.exceptions import (
    MalformedAnswer,
    MalformedChunk,
    StreamBroken,
    StreamTimedOut,
    WorkerError,
    WorkerTimeout,
    WorkerUnreachable,
)
from workers.wire import redact
from workers.wire.shapes import ShapeError
from workers.wire.sse_decoder import SSELineTooLong
from workers.wire.transport import MalformedResponse


@contextlib.contextmanager
def boundary(stage: str, *, streaming: bool = False) -> Iterator[None]:
    """Map every failure of a worker call inside the block to its `WorkerError`.

    `streaming`: the generation stream is open (its headers arrived), so a failure is a
    `StreamBroken` of the matching kind. A `WorkerError` raised inside passes through.
    """
    try:
        yield
    except WorkerError:
        raise
    except (TimeoutError, httpx.TimeoutException) as exc:
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            raise _unreachable(stage, exc) from exc
        timeout_class = StreamTimedOut if streaming else WorkerTimeout
        raise timeout_class(
            504, f"the {stage} worker timed out", stage=stage, code="timeout", detail=_describe(exc, stage, "timed out")
        ) from exc
    except MalformedResponse as exc:
        raise MalformedAnswer(
            502, f"the {stage} worker sent a malformed HTTP response", stage=stage, code="malformed_answer",
            detail=_describe(exc, stage, "malformed response"),
        ) from exc
    except httpx.HTTPError as exc:
        if streaming:
            raise StreamBroken(
                502,
                f"the {stage} worker closed the stream before it was complete",
                stage=stage,
                code="stream_broken",
                detail=_describe(exc, stage, "stream broken"),
            ) from exc
        raise _unreachable(stage, exc) from exc
    except SSELineTooLong as exc:
        raise MalformedChunk(
            502,
            f"the {stage} worker sent a stream line longer than {exc.limit} bytes",
            stage=stage,
            code="answer_too_large",
        ) from exc
    except ShapeError as exc:
        # The message names only the field (a path the checker built), never the worker's data.
        if streaming:
            raise MalformedChunk(
                502, f"the {stage} worker sent a malformed stream chunk: {exc}", stage=stage, code="malformed_answer"
            ) from exc
        raise MalformedAnswer(
            502, f"the {stage} worker sent a malformed answer: {exc}", stage=stage, code="malformed_answer"
        ) from exc
    except orjson.JSONDecodeError as exc:
        what = "stream chunk" if streaming else "answer"
        error_class = MalformedChunk if streaming else MalformedAnswer
        raise error_class(
            502,
            f"the {stage} worker sent a malformed {what}: it is not JSON",
            stage=stage,
            code="malformed_answer",
            detail=redact.audit_text(f"{what} is not JSON: {exc}"),
        ) from exc


def _unreachable(stage: str, exc: BaseException) -> WorkerUnreachable:
    return WorkerUnreachable(
        503, f"the {stage} worker could not be reached", stage=stage, code="unreachable", detail=_describe(exc, stage, "unreachable")
    )


def _describe(exc: BaseException, stage: str, what: str) -> str:
    """For the audit row: the exception's kind and text (an httpx error names the worker's
    address, which an operator wants and a client must not see)."""
    text = str(exc)
    return redact.audit_text(f"the {stage} worker {what}: {type(exc).__name__}" + (f": {text}" if text else ""))


__all__ = ["boundary"]
