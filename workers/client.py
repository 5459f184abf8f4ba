"""HTTP to workers: JSON calls and OpenAI SSE streams over httpx, on the worker transport
(`workers.transport`: aiohttp's pool and parser), one per event loop.

Errors leave this module as `WorkerError`s built from the worker's own message, never from an
httpx exception's text (which names the worker's address).
"""

from __future__ import annotations

import asyncio
import functools
import re
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from django.conf import settings

from workers.errors import (
    ContextLengthExceeded,
    StreamBroken,
    WorkerError,
    WorkerUnreachable,
)
from workers.transport import WorkerTransport

_transports: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WorkerTransport] = weakref.WeakKeyDictionary()

# How long to wait for the end of a stream's body after `[DONE]`.
DRAIN_TIMEOUT_S = 1.0

JSON_HEADERS = {"content-type": "application/json", "accept": "application/json"}
SSE_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


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


@functools.cache
def _timeouts(total: float | None = None) -> dict[str, float | None]:
    connect = settings.WORKER_CONNECT_TIMEOUT_S
    read = total if total is not None else settings.WORKER_REQUEST_TIMEOUT_S
    return httpx.Timeout(read, connect=min(connect, read), pool=connect).as_dict()


@functools.lru_cache(maxsize=1024)
def _url(url: str) -> httpx.URL:
    return httpx.URL(url)  # endpoints are few: parse each once


async def _send(method: str, url: str, content: bytes | None, headers: dict[str, str], timeout: float | None) -> httpx.Response:
    """Send and return the response with its body unread (the caller reads or streams it)."""
    request = httpx.Request(method, _url(url), content=content, headers=headers, extensions={"timeout": _timeouts(timeout)})
    response = await transport().handle_async_request(request)
    response.request = request
    return response


# --- error bodies ------------------------------------------------------------------------------

_MAX_CONTEXT = re.compile(r"maximum context length is (\d+) tokens", re.I)
_PROMPT_TOKENS = re.compile(r"(?:resulted in|requested) (\d+) tokens(?: \((\d+) in the messages)?", re.I)


def error_message(body: bytes, status: int, stage: str) -> tuple[str, str | None]:
    """The worker's message and code from an OpenAI, TensorRT-LLM or FastAPI error body."""
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
    if not message:
        message = f"{stage} worker rejected the request with status {status}"
    return str(message), (str(code) if code is not None else None)


def worker_error(status: int, body: bytes, stage: str, retry_after: float | None = None) -> WorkerError:
    if status in (502, 503) and not body.strip():
        # A bare 502/503 comes from something in front of the worker (a proxy, a load balancer,
        # a server still starting), not from a worker that looked at the request: like a refused
        # connection, it may be retried elsewhere.
        return WorkerUnreachable(
            status, f"the {stage} worker answered {status} without a body", stage=stage, code="no_answer", retry_after=retry_after
        )
    message, code = error_message(body, status, stage)
    if status == 400 and (code == "context_length_exceeded" or _MAX_CONTEXT.search(message)):
        maximum = _MAX_CONTEXT.search(message)
        prompt = _PROMPT_TOKENS.search(message)
        if maximum and prompt:
            prompt_tokens = int(prompt.group(2) or prompt.group(1))
            return ContextLengthExceeded(
                message, stage=stage, prompt_tokens=prompt_tokens, max_context_tokens=int(maximum.group(1))
            )
    return WorkerError(status, message, stage=stage, code=code, retry_after=retry_after)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _transport_error(exc: httpx.HTTPError, stage: str) -> WorkerError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        return WorkerError(504, f"the {stage} worker timed out", stage=stage, code="timeout")
    return WorkerUnreachable(503, f"the {stage} worker could not be reached", stage=stage, code="unreachable")


# --- calls ---------------------------------------------------------------------------------------


async def _fetch(
    method: str, url: str, content: bytes | None, headers: dict[str, str], timeout: float | None, stage: str
) -> httpx.Response:
    """Send, read the whole answer, and raise WorkerError for a transport failure or a non-2xx."""
    try:
        response = await _send(method, url, content, headers, timeout)
        try:
            await response.aread()
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise _transport_error(exc, stage) from None
    if response.status_code >= 300:
        raise worker_error(response.status_code, response.content, stage, _retry_after(response))
    return response


async def post_json(
    url: str, body: dict[str, Any], *, stage: str, timeout: float | None = None
) -> dict[str, Any]:
    """POST a JSON body and return the JSON object answered; anything else raises WorkerError."""
    response = await _fetch("POST", url, orjson.dumps(body), JSON_HEADERS, timeout, stage)
    try:
        data = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise WorkerError(502, f"the {stage} worker returned a malformed answer", stage=stage)
    return data


async def get_json(url: str, *, timeout: float, stage: str = "health") -> Any:
    response = await _fetch("GET", url, None, {"accept": "application/json"}, timeout, stage)
    return orjson.loads(response.content) if response.content else None


class ChunkStream:
    """An open OpenAI chat stream: iterate parsed chunks until `[DONE]`; close it when done.

    The response headers (status 200) have arrived when this exists. Iteration raises
    `StreamBroken` if the stream ends without `[DONE]`, and `WorkerError` for an error frame.
    """

    def __init__(self, response: httpx.Response, stage: str) -> None:
        self._response = response
        self._stage = stage
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        buffer = b""
        loads = orjson.loads
        raw_chunks = self._response.aiter_raw()
        try:
            async for raw in raw_chunks:
                buffer += raw
                # SSE lines end in \n; splitting bytes there never cuts a UTF-8 character in two.
                if b"\n" not in raw:
                    continue
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, `event:` lines
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        self.finished = True
                        await self._drain(raw_chunks)
                        return
                    try:
                        chunk = loads(payload)
                    except orjson.JSONDecodeError:
                        raise StreamBroken(502, "the generation worker sent a malformed stream chunk", stage=self._stage) from None
                    if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
                        raise self._error_frame(chunk)
                    yield chunk
        except httpx.HTTPError:
            raise StreamBroken(
                502, "the generation worker closed the stream before it was complete", stage=self._stage
            ) from None
        raise StreamBroken(502, "the generation worker closed the stream before it was complete", stage=self._stage)

    async def _drain(self, raw_chunks: AsyncIterator[bytes]) -> None:
        """Read the body's end after `[DONE]` (the chunked terminator follows at once) so the
        connection goes back to the pool instead of being closed half-read."""
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                async for _ in raw_chunks:
                    pass
        except (TimeoutError, httpx.HTTPError):
            pass  # the connection is closed instead of reused; the answer is complete anyway

    def _error_frame(self, chunk: dict[str, Any]) -> WorkerError:
        err = chunk["error"]
        status = 500
        if isinstance(err, dict) and isinstance(err.get("code"), int):
            status = err["code"]
        return worker_error(status, orjson.dumps(chunk), self._stage)

    async def aclose(self) -> None:
        await self._response.aclose()


async def open_stream(url: str, body: dict[str, Any], *, stage: str) -> ChunkStream:
    """POST a streamed chat request and wait for the response headers."""
    try:
        response = await _send("POST", url, orjson.dumps(body), SSE_HEADERS, None)
    except httpx.HTTPError as exc:
        raise _transport_error(exc, stage) from None
    if response.status_code >= 300:
        try:
            content = await response.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await response.aclose()
        raise worker_error(response.status_code, content, stage, _retry_after(response))
    return ChunkStream(response, stage)
