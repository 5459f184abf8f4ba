"""HTTP to workers: JSON calls and OpenAI SSE streams, answered as httpx responses, on the worker
transport (`workers.wire.transport`: aiohttp's pool and parser), one per event loop.

    completion = await post_completion(url, body, stage="context")   # validated chat.completion
    stream = await open_stream(url, body, stage="generation")        # headers in
    await stream.pump(sink)                                           # validated chunks to [DONE]
    await stream.aclose()

Every failure leaves as a `WorkerError` (workers.exceptions), from the error boundary
(`workers.wire.boundary`): transport errors, passed deadlines, answers too large, undecodable or
of the wrong shape. A worker's non-2xx answer becomes one in `workers.wire.error_reading`, whose
client message is the engine's own, scrubbed, never an httpx exception's text (which names the
worker's address); a call to a chat endpoint passes the engine's `wordings`, with which it tells a
request too long for the context window from the rest.

Deadlines are totals per phase (`asyncio.timeout` per call here, one timer per stream in
`workers.wire.chat_stream`), not per read: the transport gets no read timeout. A call's answer is
read incrementally and cut at its size limit.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import orjson
from django.conf import settings

from disagg_project import tracing
from workers.exceptions import AnswerTooLarge
from workers.wire.boundary import boundary
from workers.wire.chat_stream import ChunkStream
from workers.wire.error_reading import Wordings, worker_error
from workers.wire.push import body_reader
from workers.wire.raw_ints import loads_keeping_ints
from workers.wire.shapes import ShapeError, check_completion
from workers.wire.transport import WorkerTransport

_transports: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WorkerTransport] = weakref.WeakKeyDictionary()

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
    (URL merging, cookies, auth, redirects, event hooks) do nothing for a worker call, and cost
    per call (bench/results/2026-12-03-worker-transport-decision.md).
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


def _connect_timeout(deadline_s: float) -> float:
    """The transport's own timeout: connecting only, for a pool slot and for the connection (a
    connect timeout is "unreachable", which may be retried elsewhere). Reads get none: the
    caller's phase deadline covers them."""
    return min(settings.WORKER_CONNECT_TIMEOUT_S, deadline_s)


async def _send(method: str, url: str, content: bytes | None, headers: dict[str, str], deadline_s: float) -> httpx.Response:
    """Send and return the response with its body unread (the caller reads or streams it)."""
    connect = _connect_timeout(deadline_s)
    return await transport().send(method, url, headers, content, connect, None, connect)


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
    async for part in _body_parts(response):
        size += len(part)
        if size > limit:
            raise AnswerTooLarge(502, _too_large(stage, limit), stage=stage, code="answer_too_large")
        parts.append(part)
    return b"".join(parts)


async def _body_parts(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive. Straight from the transport (`body_reader`): httpx's
    decoding layers cost more than the rest of a small call's read; through them only when the
    worker compressed the body although the gateway asked for no encoding."""
    if response.headers.get("content-encoding", "identity").lower() != "identity":
        async for part in response.aiter_bytes():
            yield part
        return
    read = body_reader(response)
    while part := await read():
        yield part


def _too_large(stage: str, limit: int) -> str:
    return f"the {stage} worker's answer is larger than {limit} bytes"


async def _error_body(response: httpx.Response) -> bytes:
    """The first ERROR_BODY_BYTES of an error answer (a message is short; the rest is dropped)."""
    parts: list[bytes] = []
    size = 0
    async for part in _body_parts(response):
        parts.append(part)
        size += len(part)
        if size >= ERROR_BODY_BYTES:
            break
    return b"".join(parts)[:ERROR_BODY_BYTES]


# --- calls ---------------------------------------------------------------------------------------


async def _fetch(
    method: str, url: str, content: bytes | None, headers: dict[str, str], deadline_s: float, stage: str, wordings: Wordings = ()
) -> bytes:
    """Send and read the whole answer within `deadline_s`; raise WorkerError for any failure
    or a non-2xx answer (read with the engine's `wordings`)."""
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
    raise worker_error(response.status_code, error_body, stage, _retry_after(response), wordings=wordings)


async def post_json(
    url: str,
    body: JsonBody,
    *,
    stage: str,
    timeout: float | None = None,
    headers: Mapping[str, str] | None = None,
    wordings: Wordings = (),
    relayed_ints: str | None = None,
) -> dict[str, Any]:
    """POST a JSON body and return the JSON object answered, all within `timeout` (default
    WORKER_REQUEST_TIMEOUT_S); anything else raises WorkerError. `headers` add to the JSON ones.
    A top-level `relayed_ints` field holding a large array of ints comes back as its JSON text
    (an `orjson.Fragment`: workers.wire.raw_ints)."""
    sent = {**JSON_HEADERS, **headers} if headers else JSON_HEADERS
    span = None
    if tracing.on:
        # A CLIENT span named for the stage (context, tokenize), its traceparent sent (in a copy).
        sent = dict(sent)
        span = tracing.worker_call(stage, "POST", url, sent)
    try:
        content = await _fetch("POST", url, _encoded(body), sent, timeout or settings.WORKER_REQUEST_TIMEOUT_S, stage, wordings)
    except BaseException as exc:
        if span is not None:
            tracing.end(span, exc)
        raise
    if span is not None:
        tracing.end(span)
    with boundary(stage):
        data = orjson.loads(content) if relayed_ints is None else loads_keeping_ints(content, relayed_ints)
        if not isinstance(data, dict):
            raise ShapeError("the answer", "is not an object")
    return data


async def post_completion(
    url: str,
    body: JsonBody,
    *,
    stage: str,
    timeout: float | None = None,
    headers: Mapping[str, str] | None = None,
    wordings: Wordings = (),
    relayed_ints: str | None = None,
) -> dict[str, Any]:
    """POST a non-streamed chat request and return its chat completion, checked against the
    documented shape (workers.wire.shapes), all within `timeout` (default WORKER_CONTEXT_TIMEOUT_S);
    an error answer is read with the engine's `wordings`; `relayed_ints` as in `post_json`."""
    completion = await post_json(
        url, body, stage=stage, timeout=timeout or settings.WORKER_CONTEXT_TIMEOUT_S, headers=headers, wordings=wordings,
        relayed_ints=relayed_ints,
    )
    with boundary(stage):
        return check_completion(completion)


async def get_json(url: str, *, timeout: float, stage: str = "health") -> Any:
    content = await _fetch("GET", url, None, {"accept": "application/json"}, timeout, stage)
    with boundary(stage):
        return orjson.loads(content) if content else None


async def get_text(url: str, *, timeout: float, limit: int, stage: str) -> str:
    """GET a text answer (an engine's Prometheus metrics) within `timeout`, at most `limit` bytes
    of it (AnswerTooLarge past that), decoded as UTF-8 with what is not replaced; anything else
    raises WorkerError."""
    with boundary(stage):
        async with asyncio.timeout(timeout):
            response = await _send("GET", url, None, {"accept": "text/plain"}, timeout)
            try:
                if response.status_code < 300:
                    return (await _read_bounded(response, limit, stage)).decode("utf-8", "replace")
                error_body = await _error_body(response)
            finally:
                await response.aclose()
    raise worker_error(response.status_code, error_body, stage, _retry_after(response))


async def open_stream(
    url: str,
    body: JsonBody,
    *,
    stage: str,
    headers: Mapping[str, str] | None = None,
    waits_for_context: bool = False,
    wordings: Wordings = (),
) -> ChunkStream:
    """POST a streamed chat request and wait for the response headers.

    The first body byte is due WORKER_FIRST_BYTE_TIMEOUT_S after sending, plus
    WORKER_CONTEXT_TIMEOUT_S when `waits_for_context` (generation first: the worker cannot answer
    before the context phase, which has that deadline, ends); the whole stream is due by
    WORKER_REQUEST_TIMEOUT_S. `headers` add to the SSE ones. An error answer, before the stream or
    in it, is read with the engine's `wordings`.
    """
    sent = {**SSE_HEADERS, **headers} if headers else SSE_HEADERS
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    ends_by = sent_at + settings.WORKER_REQUEST_TIMEOUT_S
    first_byte_s = settings.WORKER_FIRST_BYTE_TIMEOUT_S + (settings.WORKER_CONTEXT_TIMEOUT_S if waits_for_context else 0.0)
    first_byte_by = min(sent_at + first_byte_s, ends_by)
    span = None
    if tracing.on:
        # A CLIENT span named for the stage, its traceparent sent (in a copy of the headers). It
        # ends with the stream (whoever relays it ends `ChunkStream.span`), or here if the
        # stream never opens.
        sent = dict(sent)
        span = tracing.worker_call(stage, "POST", url, sent)
    try:
        with boundary(stage):
            async with asyncio.timeout_at(first_byte_by):
                response = await _send("POST", url, _encoded(body), sent, first_byte_by - sent_at)
                if response.status_code >= 300:
                    try:
                        error_body = await _error_body(response)
                    finally:
                        await response.aclose()
                    raise worker_error(response.status_code, error_body, stage, _retry_after(response), wordings=wordings)
    except BaseException as exc:
        if span is not None:
            tracing.end(span, exc)
        raise
    stream = ChunkStream(response, stage, first_byte_by=first_byte_by, ends_by=ends_by, wordings=wordings)
    stream.span = span
    return stream
