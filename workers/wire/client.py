"""HTTP to workers: JSON calls and OpenAI SSE streams over httpx, on the worker transport
(`workers.wire.transport`: aiohttp's pool and parser), one per event loop.

    completion = await post_completion(url, body, stage="context")   # validated chat.completion
    stream = await open_stream(url, body, stage="generation")        # headers in
    await stream.pump(sink)                                           # validated chunks to [DONE]
    await stream.aclose()

Every failure leaves this module as a `WorkerError` (workers.exceptions), and from one place,
`boundary()`: transport errors, passed deadlines, answers too large, undecodable or of the wrong
shape. A worker's non-2xx answer becomes one in `worker_error()`, whose client message is the
engine's own, scrubbed (`workers.wire.redact`), never an httpx exception's text (which names the
worker's address).

Deadlines are totals per phase, kept here (`asyncio.timeout` per call, one `_StreamDeadline`
timer per stream), not per read: the transport gets no read timeout. A call's answer is read
incrementally and cut at its size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import httpx
import orjson
from django.conf import settings

from workers.wire import redact
from workers.exceptions import (
    AnswerTooLarge,
    ContextLengthExceeded,
    MalformedAnswer,
    MalformedChunk,
    OutputLimitExceeded,
    StreamBroken,
    StreamTimedOut,
    WorkerError,
    WorkerTimeout,
    WorkerUnreachable,
)
from workers.wire.shapes import ShapeError, check_chunk, check_completion
from workers.wire.sse_decoder import Event, SSEDecoder, SSELineTooLong
from workers.wire.transport import MalformedResponse, PushedBody, WorkerTransport, body_reader, push_body

logger = logging.getLogger(__name__)

_transports: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WorkerTransport] = weakref.WeakKeyDictionary()

# How long to wait for the end of a stream's body after `[DONE]`.
DRAIN_TIMEOUT_S = 1.0
# An error answer is read up to this many bytes (the rest is dropped: a message is short).
ERROR_BODY_BYTES = 64 * 1024

JSON_HEADERS = {"content-type": "application/json", "accept": "application/json"}
SSE_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}

#: A request body: a JSON object, or one already serialized (`RenderedChat.dumps`).
JsonBody = dict[str, Any] | bytes


def _encoded(body: JsonBody) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def transport() -> WorkerTransport:
    """The running loop's connection pools (daphne has no lifespan hook to create them at start).

    Requests go to the transport directly, not through `httpx.AsyncClient`: the client's layers
    (URL merging, cookies, auth, redirects, event hooks) cost ~200 µs per call and do nothing
    for a worker call; measured on this machine.
    """
    loop = asyncio.get_running_loop()
    worker_transport = _transports.get(loop)
    if worker_transport is None:
        worker_transport = _transports[loop] = WorkerTransport(
            max_connections=settings.WORKER_MAX_CONNECTIONS,
            keepalive_expiry=settings.WORKER_KEEPALIVE_EXPIRY_S,
            max_response_headers=settings.WORKER_MAX_RESPONSE_HEADERS,
            max_response_header_bytes=settings.WORKER_MAX_RESPONSE_HEADER_BYTES,
        )
    return worker_transport


async def close_transport() -> None:
    """Close the running loop's connection pools (at server shutdown, at the end of a test): an
    aiohttp session left open warns when it is collected and leaves sockets to the OS."""
    worker_transport = _transports.pop(asyncio.get_running_loop(), None)
    if worker_transport is not None:
        await worker_transport.aclose()


@functools.cache
def _timeouts(deadline_s: float) -> dict[str, float | None]:
    """The transport's own timeouts: connecting only (a connect timeout is "unreachable", which
    may be retried elsewhere). Reads get none: the caller's phase deadline covers them."""
    connect = min(settings.WORKER_CONNECT_TIMEOUT_S, deadline_s)
    return {"connect": connect, "pool": connect, "read": None, "write": None}


@functools.lru_cache(maxsize=1024)
def _url(url: str) -> httpx.URL:
    return httpx.URL(url)  # endpoints are few: parse each once


async def _send(method: str, url: str, content: bytes | None, headers: dict[str, str], deadline_s: float) -> httpx.Response:
    """Send and return the response with its body unread (the caller reads or streams it)."""
    request = httpx.Request(method, _url(url), content=content, headers=headers, extensions={"timeout": _timeouts(deadline_s)})
    response = await transport().handle_async_request(request)
    response.request = request
    return response


# --- the error boundary --------------------------------------------------------------------------


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


# --- error answers -------------------------------------------------------------------------------

# Every engine's wording of "the request does not fit the context window", each quoted from the
# engine's source or its real server's answer. Named groups: `maximum` the window, `prompt` the
# prompt's tokens, `query` tokens TensorRT-LLM counts beside the prompt, `output` the output
# tokens counted against the window (when present, the prompt alone may fit). A count is at most
# 12 digits: a worker's 5,000-digit number must not reach int() (which refuses over 4,300).
_OVER_LENGTH = tuple(
    re.compile(pattern, re.I)
    for pattern in (
        # vLLM (serving's max_tokens check): "This model's maximum context length is 8192 tokens.
        # However, you requested 900 output tokens and your prompt contains at least 7293 input
        # tokens, for a total of at least 8193 tokens. ..."
        r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, you requested (?P<output>\d{1,12}) output "
        r"tokens and your prompt contains at least (?P<prompt>\d{1,12}) input tokens",
        # vLLM 0.32 (a real server, tests/realengine/test_real_vllm.py): "... However, your prompt contains at
        # least 4097 input tokens, which exceeds this limit even without any output tokens. ..."
        # (it counts only to the first token past the window: a lower bound, the best there is).
        r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, your prompt contains at least "
        r"(?P<prompt>\d{1,12}) input tokens",
        # OpenAI, older vLLM: "... However, you requested 5000 tokens (4000 in the messages, 1000
        # in the completion). ..."
        r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, you requested \d+ tokens "
        r"\((?P<prompt>\d{1,12}) in the messages, (?P<output>\d{1,12}) in the completion\)",
        # OpenAI, TensorRT-LLM's OpenAI server (PR #19457, code context_length_exceeded): "This
        # model's maximum context length is 69632 tokens. However, your messages resulted in
        # 69666 tokens. Please reduce the length of the messages."
        r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, your messages resulted in (?P<prompt>\d{1,12}) tokens",
        # TensorRT-LLM before that, TensorRT backend (llmapi/llm.py `_check_arguments`; the
        # prompt length is printed as a float, prompt_len / cp_size): "The sum of prompt length
        # (4000.0) and query length (0) max_tokens (2048) should not exceed max_seq_len (4096)"
        r"The sum of prompt length \((?P<prompt>\d{1,12})(?:\.\d*)?\) and query length \((?P<query>\d{1,12})\) "
        r"max_tokens \((?P<output>\d{1,12})\) should not exceed max_seq_len \((?P<maximum>\d{1,12})\)",
        # ... PyTorch backend: "The sum of prompt length (50857.0), query length (0) should not
        # exceed max_num_tokens (32768)"
        r"The sum of prompt length \((?P<prompt>\d{1,12})(?:\.\d*)?\), query length \((?P<query>\d{1,12})\) "
        r"should not exceed max_num_tokens \((?P<maximum>\d{1,12})\)",
        # ... and `_deduce_max_tokens` (executor/base_worker.py): "`default_max_tokens` (-40205)
        # should be greater than 0, `default_max_tokens` (-40205) = max_seq_len (40961) -
        # `splited_prompt_len` (81166) - `query_token_len` (0)"
        r"`default_max_tokens` \(-?\d+\) = max_seq_len \((?P<maximum>\d{1,12})\) - `splited_prompt_len` "
        r"\((?P<prompt>\d{1,12})\) - `query_token_len` \((?P<query>\d{1,12})\)",
        # SGLang (managers/tokenizer_manager.py `_validate_one_request`): "The input (4097 tokens)
        # is longer than the model's context length (4096 tokens)."
        r"The input \((?P<prompt>\d{1,12}) tokens\) is longer than the model's context length \((?P<maximum>\d{1,12}) tokens\)",
        # ... "Requested token count exceeds the model's maximum context length of 4096 tokens.
        # You requested a total of 4200 tokens: 200 tokens from the input messages and 4000 tokens
        # for the completion. ..."
        r"Requested token count exceeds the model's maximum context length of (?P<maximum>\d{1,12}) tokens\. "
        r"You requested a total of \d+ tokens: (?P<prompt>\d{1,12}) tokens from the input messages and "
        r"(?P<output>\d{1,12}) tokens for the completion",
    )
)
# Any other sentence naming the window (a wording not above): over-length, without a prompt count.
_MAX_CONTEXT = re.compile(r"maximum context length is (?P<maximum>\d{1,12}) tokens", re.I)
# vLLM 0.32 (a real server, tests/realengine/test_real_vllm.py): "max_tokens=5000 cannot be greater than
# max_model_len=4096. Please request fewer output tokens." Not an over-length prompt: the
# output asked for is larger than the window whatever the prompt.
_OUTPUT_TOO_LARGE = re.compile(r"max_tokens=(?P<output>\d{1,12}) cannot be greater than max_model_len=(?P<maximum>\d{1,12})", re.I)


def _window_error(raw_message: str, code: str | None, message: str, stage: str, detail: str) -> WorkerError | None:
    """The over-length (or output-too-large) error a worker's message or code describes, with the
    counts read from the raw text (scrubbing must not hide them); None if it is another error."""
    for pattern in _OVER_LENGTH:
        match = pattern.search(raw_message)
        if match:
            counts = match.groupdict()
            return ContextLengthExceeded(
                message,
                stage=stage,
                prompt_tokens=int(counts["prompt"]) + int(counts.get("query") or 0),
                max_context_tokens=int(counts["maximum"]),
                output_tokens=int(counts["output"]) if counts.get("output") else None,
                detail=detail,
            )
    match = _OUTPUT_TOO_LARGE.search(raw_message)
    if match:
        return OutputLimitExceeded(
            message, stage=stage, output_tokens=int(match["output"]), max_context_tokens=int(match["maximum"]), detail=detail
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


def worker_error(status: int, body: bytes, stage: str, retry_after: float | None = None) -> WorkerError:
    """The `WorkerError` for a worker's error answer: the client message scrubbed, the raw body
    logged, a redacted copy in `detail` for the audit row."""
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
        window_error = _window_error(raw_message, code, message, stage, detail)
        if window_error is not None:
            return window_error
    return WorkerError(status, message, stage=stage, code=code, retry_after=retry_after, detail=detail)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value else None
    except ValueError:
        return None


# --- bodies ----------------------------------------------------------------------------------------


async def _read_bounded(response: httpx.Response, limit: int, stage: str) -> bytes:
    """The whole body, raising AnswerTooLarge as soon as it passes `limit` (never buffering more)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge(502, _too_large(stage, limit), stage=stage, code="answer_too_large")
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_bytes():
        size += len(part)
        if size > limit:
            raise AnswerTooLarge(502, _too_large(stage, limit), stage=stage, code="answer_too_large")
        parts.append(part)
    return b"".join(parts)


def _too_large(stage: str, limit: int) -> str:
    return f"the {stage} worker's answer is larger than {limit} bytes"


async def _error_body(response: httpx.Response) -> bytes:
    """The first ERROR_BODY_BYTES of an error answer (a message is short; the rest is dropped)."""
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_bytes():
        parts.append(part)
        size += len(part)
        if size >= ERROR_BODY_BYTES:
            break
    return b"".join(parts)[:ERROR_BODY_BYTES]


# --- calls ---------------------------------------------------------------------------------------


async def _fetch(
    method: str, url: str, content: bytes | None, headers: dict[str, str], deadline_s: float, stage: str
) -> bytes:
    """Send and read the whole answer within `deadline_s`; raise WorkerError for any failure
    or a non-2xx answer."""
    with boundary(stage):
        async with asyncio.timeout(deadline_s):
            response = await _send(method, url, content, headers, deadline_s)
            try:
                if response.status_code >= 300:
                    error_body = await _error_body(response)
                else:
                    return await _read_bounded(response, settings.WORKER_MAX_JSON_BYTES, stage)
            finally:
                await response.aclose()
    raise worker_error(response.status_code, error_body, stage, _retry_after(response))


async def post_json(
    url: str, body: JsonBody, *, stage: str, timeout: float | None = None, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """POST a JSON body and return the JSON object answered, all within `timeout` (default
    WORKER_REQUEST_TIMEOUT_S); anything else raises WorkerError. `headers` add to the JSON ones."""
    sent = {**JSON_HEADERS, **headers} if headers else JSON_HEADERS
    content = await _fetch("POST", url, _encoded(body), sent, timeout or settings.WORKER_REQUEST_TIMEOUT_S, stage)
    with boundary(stage):
        data = orjson.loads(content)
        if not isinstance(data, dict):
            raise ShapeError("the answer", "is not an object")
    return data


async def post_completion(
    url: str, body: JsonBody, *, stage: str, timeout: float | None = None, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """POST a non-streamed chat request and return its chat completion, checked against the
    documented shape (workers.wire.shapes), all within `timeout` (default WORKER_CONTEXT_TIMEOUT_S)."""
    completion = await post_json(url, body, stage=stage, timeout=timeout or settings.WORKER_CONTEXT_TIMEOUT_S, headers=headers)
    with boundary(stage):
        return check_completion(completion)


async def get_json(url: str, *, timeout: float, stage: str = "health") -> Any:
    content = await _fetch("GET", url, None, {"accept": "application/json"}, timeout, stage)
    with boundary(stage):
        return orjson.loads(content) if content else None


class _StreamDeadline:
    """The deadline of one stream's reads, with one timer for the whole stream: when it passes,
    the outcome the stream's `pump` awaits fails with TimeoutError.

    A stream's deadline moves with every event (the idle gap counts from the last one); entering
    `asyncio.timeout_at` around each read cost about as much as decoding the event (measured,
    ~8 µs on the test machine). Here moving the deadline is an assignment; the timer, when it
    fires early, re-arms itself for the deadline's new value. So a deadline moved later may be
    assigned to `when` directly (per relayed token); `move` is needed only for an earlier one.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, outcome: asyncio.Future[bool]) -> None:
        self.loop = loop
        self.when = float("inf")
        self._outcome = outcome
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for = float("inf")  # the timer's time (inf: none armed)

    def move(self, when: float) -> None:
        self.when = when
        if when < self._armed_for:  # only an earlier deadline needs the timer moved
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self.loop.call_at(when, self._fire)
            self._armed_for = when

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_for = float("inf")

    def _fire(self) -> None:
        self._handle = None
        self._armed_for = float("inf")
        if self.loop.time() < self.when:
            self._handle = self.loop.call_at(self.when, self._fire)  # moved later meanwhile
            self._armed_for = self.when
        elif not self._outcome.done():
            self._outcome.set_exception(TimeoutError())


class _SinkFailed(Exception):
    """Carries what a pushed stream's sink raised past the worker-error mapping."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


class ChunkStream:
    """An open OpenAI chat stream: `pump` its validated chunks until `[DONE]`; close it when done.

    The response headers (status 200) have arrived when this exists. `pump` raises
    `StreamBroken` (or its subclasses `StreamTimedOut`, `MalformedChunk`) when the stream ends
    without `[DONE]`, goes silent past its deadlines or sends a malformed chunk, and the worker's
    `WorkerError` for an error frame (`event: error`, or a data frame `{"error": ...}`).
    """

    def __init__(self, response: httpx.Response, stage: str, *, first_byte_by: float, ends_by: float) -> None:
        self._response = response
        self._stage = stage
        self._first_byte_by: float | None = first_byte_by  # loop time; None once a byte came
        self._ends_by = ends_by  # loop time: the whole call's deadline
        self._deadline: _StreamDeadline | None = None
        self._idle_s: float = settings.WORKER_IDLE_TIMEOUT_S  # read once: this runs per token
        self._pumping = False
        self._push: PushedBody | None = None  # while `pump` runs
        self._paused = False

    async def pump(self, sink: Callable[[dict[str, Any]], None]) -> None:
        """Each validated chunk to `sink` as it arrives, until `[DONE]`. `sink` runs in the worker
        connection's receive callback, so it must not wait (`pause` holds the worker back); what
        it raises ends the stream and is raised here as it is, never as the worker's failure.

        Why pushed: a stream relays one token per read, and a read the task awaits costs a
        future, a loop callback and a task step that resumes the reader through every `await`
        up to the consumer's loop; here the bytes reach the decoder, the chunk checks and `sink`
        in the call that received them."""
        loop = asyncio.get_running_loop()
        # True once [DONE] came; the stream's failure otherwise.
        outcome: asyncio.Future[bool] = loop.create_future()
        decoder = SSEDecoder(settings.WORKER_MAX_SSE_LINE_BYTES)
        deadline = self._deadline = _StreamDeadline(loop, outcome)
        idle_s, ends_by = self._idle_s, self._ends_by
        # The loop's clock, read per token: asyncio's is time.monotonic behind a Python method.
        clock = time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else loop.time

        def deliver(events: list[Event]) -> bool:
            """Pass on the events' chunks; False once the stream is over ([DONE] or a failure)."""
            for event in events:
                chunk = self._chunk(event)
                if chunk is None:
                    outcome.set_result(True)
                    return False
                try:
                    sink(chunk)
                except BaseException as exc:  # the consumer's own failure, raised as it is
                    outcome.set_exception(_SinkFailed(exc))
                    return False
            return True

        def on_data(data: bytes) -> bool:
            if outcome.done():  # the deadline passed meanwhile
                return False
            try:
                events = decoder.feed(data)
                # The first byte, then every complete event, restarts the idle gap.
                if self._first_byte_by is not None:
                    self._first_byte_by = None
                    deadline.move(min(clock() + idle_s, ends_by))
                elif events:
                    # Later than the deadline before it (the clock only moves on; `ends_by` is
                    # fixed), so an assignment, not `move`: the timer re-arms itself when it fires.
                    deadline.when = min(clock() + idle_s, ends_by)
                return deliver(events)
            except Exception as exc:  # malformed, an error frame, a line too long
                outcome.set_exception(exc)
                return False

        def on_end(error: BaseException | None) -> None:
            if outcome.done():
                return
            if error is not None:  # the connection failed
                outcome.set_exception(error)
                return
            try:
                if deliver(decoder.end()):  # the body ended without [DONE]
                    outcome.set_exception(self._broken())
            except Exception as exc:
                outcome.set_exception(exc)

        deadline.move(min(self._first_byte_by or loop.time() + idle_s, ends_by))
        self._pumping = True
        failed: BaseException | None = None
        try:
            # What has arrived already is pushed from here, before it returns.
            push = self._push = push_body(self._response, on_data, on_end)
            if push is None:  # open_stream's responses are always the worker transport's
                raise TypeError("a stream's response must come from the worker transport")
            if self._paused:  # by the sink, meanwhile
                push.pause_reading()
            with boundary(self._stage, streaming=True):
                try:
                    await outcome
                except _SinkFailed as exc:
                    failed = exc.error
        finally:
            self._pumping = False
            push, self._push = self._push, None
            if push is not None:
                push.stop()
                if self._paused:  # what remains of the body is read (drained, or closed) from here
                    push.resume_reading()
            self._paused = False
            deadline.close()
        if failed is not None:
            raise failed
        await self._drain(body_reader(self._response))

    def pause(self) -> None:
        """Read nothing more from the worker until `resume` (backpressure: a client slower than
        its worker). The idle gap does not count meanwhile, as it did not while a reader was
        busy elsewhere; the whole call's deadline does. Outside a `pump`, nothing to pause."""
        deadline = self._deadline
        if not self._pumping or deadline is None or self._paused:
            return
        self._paused = True
        deadline.when = self._ends_by  # later than the idle gap's: an assignment (see _StreamDeadline)
        if self._push is not None:
            self._push.pause_reading()

    def resume(self) -> None:
        """Read the worker again, its idle gap counted from now."""
        deadline = self._deadline
        if not self._paused or deadline is None:
            return
        self._paused = False
        deadline.move(min(deadline.loop.time() + self._idle_s, self._ends_by))
        if self._push is not None:
            self._push.resume_reading()

    def _broken(self) -> StreamBroken:
        return StreamBroken(
            502, f"the {self._stage} worker closed the stream before it was complete", stage=self._stage, code="stream_broken"
        )

    def _chunk(self, event: Event) -> dict[str, Any] | None:
        """The checked chunk an event carries; None for `[DONE]`."""
        data = event.data
        if event.event == "error":
            raise self._error_frame(data.encode())
        if data[:1] != "{" and data.strip() == "[DONE]":
            return None
        chunk = orjson.loads(data)
        if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
            raise self._error_frame(data.encode())
        return check_chunk(chunk)

    async def _drain(self, read: Callable[[], Awaitable[bytes]]) -> None:
        """Read the body's end after `[DONE]` (the chunked terminator follows at once) so the
        connection goes back to the pool instead of being closed half-read."""
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                while await read():
                    pass
        except (TimeoutError, httpx.HTTPError):
            pass  # the connection is closed instead of reused; the answer is complete anyway

    def _error_frame(self, body: bytes) -> WorkerError:
        status = 500
        try:
            err = orjson.loads(body).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            err = None
        if isinstance(err, dict) and type(err.get("code")) is int and 400 <= err["code"] < 600:
            status = err["code"]
        return worker_error(status, body, self._stage)

    async def aclose(self) -> None:
        if self._deadline is not None:
            self._deadline.close()
        await self._response.aclose()


async def open_stream(
    url: str,
    body: JsonBody,
    *,
    stage: str,
    headers: Mapping[str, str] | None = None,
    waits_for_context: bool = False,
) -> ChunkStream:
    """POST a streamed chat request and wait for the response headers.

    The first body byte is due WORKER_FIRST_BYTE_TIMEOUT_S after sending, plus
    WORKER_CONTEXT_TIMEOUT_S when `waits_for_context` (generation first: the worker cannot answer
    before the context phase, which has that deadline, ends); the whole stream is due by
    WORKER_REQUEST_TIMEOUT_S. `headers` add to the SSE ones.
    """
    sent = {**SSE_HEADERS, **headers} if headers else SSE_HEADERS
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    ends_by = sent_at + settings.WORKER_REQUEST_TIMEOUT_S
    first_byte_s = settings.WORKER_FIRST_BYTE_TIMEOUT_S + (settings.WORKER_CONTEXT_TIMEOUT_S if waits_for_context else 0.0)
    first_byte_by = min(sent_at + first_byte_s, ends_by)
    with boundary(stage):
        async with asyncio.timeout_at(first_byte_by):
            response = await _send("POST", url, _encoded(body), sent, first_byte_by - sent_at)
            if response.status_code >= 300:
                try:
                    error_body = await _error_body(response)
                finally:
                    await response.aclose()
                raise worker_error(response.status_code, error_body, stage, _retry_after(response))
    return ChunkStream(response, stage, first_byte_by=first_byte_by, ends_by=ends_by)
