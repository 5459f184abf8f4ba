"""The httpx transport for calls to workers: aiohttp's connection pool and C response parser
behind httpx's interface (the `httpx-aiohttp` package), configured and corrected for worker calls.

    transport = WorkerTransport(max_connections=4096, keepalive_expiry=4.0)
    response = await transport.send("POST", url, {"content-type": "application/json"}, body, connect_timeout=5.0)
    read = body_reader(response)  # or push_body(response, on_data, on_end): workers.wire.push
    while chunk := await read(): ...
    await response.aclose()     # back to the pool if the answer was read whole, else closed

(`handle_async_request(httpx.Request(...))`, httpx's transport interface, does the same.) The
response's body is read or pushed by `workers.wire.push`; a chunked body (every streamed answer)
is decoded by the gateway's own decoder on the connection (`workers.wire.connection`). This module
uses aiohttp's public API only.

What this adds to `httpx_aiohttp.AiohttpTransport`:

- **Exceptions mapped by what happened** (`_mapped`): connect failures are
  `ConnectError`/`ConnectTimeout`, read timeouts `ReadTimeout`, a hang-up
  `RemoteProtocolError`/`ReadError`, a malformed or oversized head `MalformedResponse` (a
  `RemoteProtocolError`); their text never names the worker's address. A pool timeout is a
  `ConnectTimeout` (aiohttp times the wait for a slot and the connect together). The package's
  own mapping makes every `ClientConnectionError` a `ConnectTimeout` and lets aiohttp's parser
  errors escape.
- **The stale keep-alive retry.** A request that went out on a *reused* connection
  (`workers.wire.connection.connection_reused`) and got only a hang-up (`ServerDisconnectedError`,
  or a reset) is sent once more on a fresh connection; a fresh connection's hang-up is not
  retried (the worker may have seen the request). aiohttp resends only idempotent methods, and
  worker calls are POSTs: without this, the race would count as an endpoint failure for health
  and the breakers.
- **Bounded response heads.** aiohttp bounds the header count and each field's size while
  parsing; the total size is checked when the head is complete (meanwhile at most
  count × field size bytes are held). One field over 8,190 bytes is refused even when the total
  is under the limit: workers send no such header.
- **No read-ahead beyond a bounded buffer** (`read_bufsize`: aiohttp pauses the socket at twice
  it), keep-alive expiry and a per-endpoint connection bound from the settings, no cookies, no
  added `User-Agent`/`Accept-Encoding`, no proxy from the environment. aiohttp sets TCP_NODELAY
  on every connection itself.
- **No httpx request per call.** `send` takes plain headers and builds no `httpx.Request`; only a
  failure's exception gets one (`exc.request`, from `request_of`).
- **A large request body goes out in slices** (`BODY_SLICE_BYTES`, with its Content-Length, not
  chunked), each waiting for the socket to drain, so other streams go on between them: aiohttp
  would write a bytes body with one `transport.write`, in one turn of the event loop.

Why a library and not our own, and what each of these costs or saves:
bench/results/2026-12-03-worker-transport-decision.md.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator, Mapping

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from workers.wire.connection import connection_reused, use_worker_protocol
from workers.wire.push import RequestOf, ResponseStream

# aiohttp pauses reading from a connection when twice this many body bytes are unread.
READ_BUFSIZE = 128 * 1024
# aiohttp's own default bound on one header field or the status line.
MAX_FIELD_SIZE = 8190
# A request body larger than this is written this many bytes at a time (a Claude Code turn,
# 80-190 KB, still goes in one write).
BODY_SLICE_BYTES = 1024 * 1024


async def _slices(body: bytes) -> AsyncIterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), BODY_SLICE_BYTES):
        yield view[start : start + BODY_SLICE_BYTES]


@functools.lru_cache(maxsize=64)
def _client_timeout(connect: float | None, read: float | None, pool: float | None) -> aiohttp.ClientTimeout:
    # `connect` in aiohttp is the wait for a pool slot and the connect together.
    return aiohttp.ClientTimeout(total=None, connect=pool, sock_connect=connect, sock_read=read)


class MalformedResponse(httpx.RemoteProtocolError):
    """The worker answered, but with a head no HTTP parser should accept (malformed, or past the
    header limits): a broken answer, not a lost connection, so it is never retried elsewhere."""


def _mapped(exc: BaseException) -> httpx.TransportError | None:
    """The httpx exception for an aiohttp one, None for anything else. Never aiohttp's text,
    which names the worker's address."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout("timed out connecting to the server")
    if isinstance(exc, (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError, TimeoutError)):
        return httpx.ReadTimeout("timed out reading the response")
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unresolvable, TLS and certificate failures
        return httpx.ConnectError(f"could not connect to the server ({type(exc).__name__})")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError("the server closed the connection")
    if isinstance(exc, aiohttp.ClientResponseError):  # aiohttp's parser refused the head
        return MalformedResponse(f"the server sent a malformed or oversized HTTP response ({exc.message})")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError("the server sent an incomplete or malformed body")
    if isinstance(exc, (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError)):
        return httpx.UnsupportedProtocol("unsupported worker URL")
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return httpx.ReadError(f"the connection to the server failed ({type(exc).__name__})")
    return None


class WorkerTransport(AiohttpTransport):
    """HTTP/1.1 to workers over aiohttp; one instance per event loop (its session belongs to it)."""

    def __init__(
        self,
        *,
        max_connections: int = 4096,
        keepalive_expiry: float = 4.0,
        max_response_headers: int = 100,
        max_response_header_bytes: int = 64 * 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            verify=ssl_context if ssl_context is not None else True,
            trust_env=False,  # never route worker calls through a proxy from the environment
            limits=httpx.Limits(max_connections=max_connections, keepalive_expiry=keepalive_expiry),
            client=self._new_session,
        )
        self.max_response_headers = max_response_headers
        self.max_response_header_bytes = max_response_header_bytes

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0,  # no bound across endpoints; the bound is per endpoint
            limit_per_host=self.limits.max_connections or 0,
            keepalive_timeout=self.limits.keepalive_expiry,
            ssl=self.ssl_context,
        )
        use_worker_protocol(connector)  # chunked bodies decoded by workers.wire.connection
        field_size = min(MAX_FIELD_SIZE, self.max_response_header_bytes)
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            auto_decompress=False,
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None),
            read_bufsize=READ_BUFSIZE,
            max_headers=self.max_response_headers,
            max_field_size=field_size,
            max_line_size=field_size,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport interface (tests, the simulator's transfers): `send` with the request's parts."""
        timeouts = request.extensions.get("timeout") or {}
        return await self.send(
            request.method,
            str(request.url),
            request.headers,
            request.content or None,  # in memory: worker calls never stream a request body
            timeouts.get("connect"),
            timeouts.get("read"),
            timeouts.get("pool"),
            request_of=lambda: request,
        )

    async def send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        connect_timeout: float | None,
        read_timeout: float | None = None,
        pool_timeout: float | None = None,
        *,
        request_of: RequestOf | None = None,
    ) -> httpx.Response:
        """Send a request and return its response with the body unread, without building an
        `httpx.Request` for it (the gateway's own worker calls: `workers.wire.client`). A failure
        raises httpx's exception for it, naming the request `request_of()` builds (by default a
        bare one of `method` and `url`)."""
        if not isinstance(self.client, aiohttp.ClientSession):
            self.client = self.get_client()
        session = self.client
        timeout = _client_timeout(connect_timeout, read_timeout, pool_timeout)
        if request_of is None:
            request_of = functools.partial(httpx.Request, method, url)
        sliced = body is not None and len(body) > BODY_SLICE_BYTES
        if sliced:
            # With its Content-Length: aiohttp would send a body of slices chunked.
            headers = {**headers, "content-length": str(len(body or b""))}
        for attempt in (1, 2):
            connection_reused.set(False)
            try:
                response = await session.request(
                    method,
                    url,
                    headers=headers,
                    data=_slices(body) if sliced and body is not None else body,
                    allow_redirects=False,
                    timeout=timeout,
                )
                break
            except Exception as exc:
                stale = isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and not isinstance(
                    exc, aiohttp.ClientConnectorError
                )
                if stale and connection_reused.get() and attempt == 1:
                    # A kept-alive connection the server closed as we reused it: the request never
                    # got an answer, so it goes out once more on a fresh connection.
                    continue
                mapped = _mapped(exc)
                if mapped is None:
                    raise
                mapped.request = request_of()
                raise mapped from None
        raw_headers = response.raw_headers
        head_bytes = sum(len(name) + len(value) + 4 for name, value in raw_headers)
        if head_bytes > self.max_response_header_bytes:
            response.close()
            raise MalformedResponse(
                f"the response head exceeds {self.max_response_header_bytes} bytes", request=request_of()
            )
        return httpx.Response(
            response.status,
            headers=raw_headers,
            stream=ResponseStream(response, request_of, _mapped),
            extensions={"http_version": b"HTTP/1.1"},
        )


__all__ = ["BODY_SLICE_BYTES", "MalformedResponse", "WorkerTransport"]
