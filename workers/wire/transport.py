"""The httpx transport for calls to workers: aiohttp's connection pool and C response parser
behind httpx's interface (the `httpx-aiohttp` package), configured and corrected for worker calls.
A chunked body (every streamed answer) is decoded by the gateway's own decoder instead
(`workers.wire.connection`: three Python calls per relayed token, from the connection's
`data_received` to the push, where aiohttp's path made about a dozen).

    transport = WorkerTransport(max_connections=4096, keepalive_expiry=4.0)
    response = await transport.send("POST", url, {"content-type": "application/json"}, body, connect_timeout=5.0)
    read = body_reader(response)  # or push_body(response, on_data, on_end)
    while chunk := await read(): ...
    await response.aclose()     # back to the pool if the answer was read whole, else closed

(`handle_async_request(httpx.Request(...))`, httpx's transport interface, does the same.)

Why a library and not our own: a hand-written HTTP/1.1 client (asyncio protocols + httptools) was
compared with this one by `bench/transport.py` (issue 10, at commit 8d54448; the numbers are in
bench/README.md). It was cheaper by a median 14 % of the gateway's CPU per non-streamed request,
3–4 % per relayed event with tokens arriving unpaced and 8–11 % with tokens arriving one at a
time: under the 20 % that would have paid for keeping 400 lines of pool, keep-alive races, TLS and
framing code.

What this adds to `httpx_aiohttp.AiohttpTransport`, and why:

- **Exceptions mapped by what happened.** The package maps every `ClientConnectionError` to
  `httpx.ConnectTimeout` (so a worker that hangs up mid-answer looks like one never reached),
  a pool or connect timeout to the bare `TimeoutException` (which the client would call a 504),
  and lets aiohttp's parser errors (a malformed or oversized head) escape as non-httpx exceptions.
  Here: connect failures are `ConnectError`/`ConnectTimeout`, read timeouts `ReadTimeout`, a
  hang-up `RemoteProtocolError`/`ReadError`, a malformed or oversized head `RemoteProtocolError`;
  their text never names the worker's address. A pool timeout is a `ConnectTimeout` (aiohttp
  times the wait for a slot and the connect together).
- **The stale keep-alive retry.** aiohttp resends a request whose reused connection the server
  had closed only for idempotent methods; worker calls are POSTs. A request that went out on a
  *reused* connection and got only a hang-up (`ServerDisconnectedError`, or a reset) is sent once
  more on a fresh connection (the connection's protocol tells a reused connection from a new one:
  `workers.wire.connection.connection_reused`; aiohttp's trace hooks did too, at ~15 µs a call); a fresh
  connection's hang-up is not retried (the worker may have seen the request). Without it, the
  race would count as an endpoint failure for health and the breakers.
- **Bounded response heads.** aiohttp bounds the header count and each field's size while
  parsing; the total size is checked when the head is complete (meanwhile at most
  count × field size bytes are held). One field over 8,190 bytes is refused even when the total
  is under the limit: workers send no such header.
- **No read-ahead beyond a bounded buffer** (`read_bufsize`: aiohttp pauses the socket at twice
  it), keep-alive expiry and a per-endpoint connection bound from the settings, no cookies, no
  added `User-Agent`/`Accept-Encoding`, no proxy from the environment. aiohttp sets TCP_NODELAY
  on every connection itself.
- **No httpx request per call.** The gateway's calls (`send`) pass plain headers and build no
  `httpx.Request`; only a failure's exception gets one (`exc.request`). Through httpx's request
  and its headers, aiohttp's trace hooks (now `connection_reused`) and httpx's body decoders, a
  small worker call cost ~70 µs more of the gateway's CPU (`_fetch` against a local server:
  ~280 against ~210 µs a call, bare aiohttp ~170).
- **A large request body goes out in slices** (`BODY_SLICE_BYTES`, with its Content-Length, not
  chunked): aiohttp writes a bytes body with one `transport.write`, which copies it twice (joined
  to the head, then into the transport's buffer) in one turn of the event loop — for a 32 MiB
  prompt, a slice of the loop no other request could use (bench/large_requests.py). Each slice
  waits for the socket to drain, so other streams go on between them.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from workers.wire.connection import RelayedBodyParser, connection_reused, use_worker_protocol

# aiohttp pauses reading from a connection when twice this many body bytes are unread.
READ_BUFSIZE = 128 * 1024
# aiohttp's own default bound on one header field or the status line.
MAX_FIELD_SIZE = 8190
# The most a pushed body's connection reads at once (see PushedBody).
PUSH_READ_BYTES = 64 * 1024
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


#: The request a failure's httpx exception names (`exc.request`), built only when one fails: worker
#: calls do not build an `httpx.Request` (~17 µs each) on their way out.
RequestOf = Callable[[], httpx.Request]


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request_of: RequestOf) -> None:
        self._response = response
        self._request_of = request_of
        self._content = response.content
        self._failed: httpx.TransportError | None = None  # raised by the next read()

    async def read(self) -> bytes:
        """The body's next bytes as they arrived, joined (b"" at its end); httpx's mapped error
        when the connection failed, after the bytes that arrived before it.

        What `__aiter__` does, as one call: a stream read one token at a time spends most of its
        Python time per token in the layers between the socket and the reader (httpx's
        `aiter_raw` and this class's generator are two of them), so ChunkStream calls this."""
        if self._failed is not None:
            raise self._failed
        content = self._content
        try:
            return await content.readany()  # whatever arrived, joined: fewer, larger chunks
        except Exception as exc:
            mapped = _mapped(exc)
            if mapped is None:
                raise
            mapped.request = self._request_of()
            # aiohttp raises a lost connection as soon as it has seen it, even while bytes that
            # arrived before it are still buffered: a dying worker's last tokens belong to the
            # answer, so hand them over first. `_buffer`/`_read_nowait` are aiohttp internals
            # (listed in disagg_project/relied_on.py; tests/unit/workers/wire/test_transport.py fails if they change).
            leftover = content._read_nowait(-1) if content._buffer else b""
            if leftover:
                self._failed = mapped
                return leftover
            raise mapped from None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def aclose(self) -> None:
        # Back to the pool if the body was read to its end, closed otherwise (aiohttp's rule).
        self._response.release()


class PushedBody:
    """A response body being pushed (`push_body`): it stands in for the future aiohttp's
    `StreamReader` wakes when body bytes arrive, so that they reach `on_data` from the
    connection's own receive callback, synchronously.

    A token relayed by awaiting the reader takes a future, a loop callback and a task step to
    resume the reading task through every `await` between it and the client; pushed, it is a
    call. aiohttp wakes its reader with `set_result(None)` (bytes, or the end of the body) and
    `set_exception(exc)` (the connection failed); `done()` is all it asks of the future
    otherwise. `StreamReader._waiter`, `_buffer`, `_eof`, `_exception`, `_low_water`, `_protocol`
    (and its `_reading_paused`) and `_read_nowait` are aiohttp internals, and `max_size` asyncio's
    selector transport's, all listed in disagg_project/relied_on.py (tests/unit/disagg_project/test_relied_on.py
    fails if one disappears); tests/unit/workers/wire/test_transport.py and tests/e2e/test_stream_fairness.py
    fail if they change.

    A chunked body decoded by `workers.wire.connection.RelayedBodyParser` (a worker's stream,
    nearly always) is pushed from there instead: the parser calls `on_data` with the body's bytes
    and `body_ended` at its end, and the reader is left alone."""

    __slots__ = (
        "_content", "_request_of", "on_data", "_on_end", "_finished", "_low_water", "_transport", "_max_size", "_parser",
    )

    def __init__(
        self,
        content: aiohttp.StreamReader,
        request_of: RequestOf,
        on_data: Callable[[bytes], bool],
        on_end: Callable[[BaseException | None], None],
        parser: RelayedBodyParser | None = None,
    ) -> None:
        self._content = content
        self._request_of = request_of
        self.on_data = on_data
        self._on_end = on_end
        self._finished = False
        self._parser = parser  # the parser that pushes (see `attach`); None: the reader wakes us
        self._low_water = content._low_water
        if parser is None:
            # Reading what was fed makes the reader resume its protocol, which feeds its parser an
            # empty buffer: from inside the parser's own callback (here) that re-entered the C
            # parser, which then never released the outer buffer (each received chunk leaked).
            # The reader is drained at every feed, so it never pauses its protocol and needs no
            # resume: a negative low-water mark keeps it from trying while pushes run. Restored
            # by `stop`.
            content._low_water = -1
        # A worker's burst (an unpaced stream, or tokens that queued up) comes as reads of up to
        # 256 KiB (asyncio's `max_size`), each relayed in one callback: it would hold the loop for
        # every event in it, keeping other streams and this client's own hang-up waiting. While
        # pushes run, the connection reads at most PUSH_READ_BYTES at a time (about 70 chat
        # chunks; a paced stream's token is one small read either way). Restored by `stop`.
        transport: Any = getattr(content._protocol, "transport", None)
        self._transport = transport
        self._max_size = getattr(transport, "max_size", None)
        if isinstance(self._max_size, int):
            transport.max_size = min(self._max_size, PUSH_READ_BYTES)

    def done(self) -> bool:
        return self._finished

    def set_result(self, _result: None) -> None:
        content = self._content
        content._waiter = None
        if self._take_what_arrived():
            content._waiter = self  # type: ignore[assignment]  # the next bytes come here too

    def _take_what_arrived(self) -> bool:
        """What the reader holds, to `on_data`; then its end or its failure, if that came too.
        True while the push goes on."""
        content = self._content
        if content._buffer and not self.on_data(content._read_nowait(-1)):
            self.stop()  # on_data wants no more
            return False
        if self._finished:
            return False
        if content._exception is not None:
            self.set_exception(content._exception)
            return False
        if content._eof and not content._buffer:
            self.stop()
            self._on_end(None)
            return False
        return True

    def set_exception(self, exc: BaseException) -> None:
        self._content._waiter = None
        if self._finished:
            return
        self.stop()
        mapped = _mapped(exc)
        if mapped is None:
            self._on_end(exc)  # not a connection failure: raised as it is, as a read would
            return
        mapped.request = self._request_of()
        self._on_end(mapped)

    def body_ended(self, error: BaseException | None) -> None:
        """From the parser that pushes: the body's end, or what failed it."""
        if error is not None:
            self.set_exception(error)
        elif not self._finished:
            self.stop()
            self._on_end(None)

    def attach(self) -> None:
        """Take the body from the parser: what its reader holds already first, then every read."""
        assert self._parser is not None
        if self._take_what_arrived():
            self._parser.sink = self

    def pause_reading(self) -> None:
        """Backpressure: the connection reads nothing more until `resume_reading` (the bytes of
        the read being pushed still go on; a read is at most PUSH_READ_BYTES)."""
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        """The connection reads again (from the next loop turn: nothing is pushed from here)."""
        if self._transport is not None:
            self._transport.resume_reading()

    def stop(self) -> None:
        """No more pushes (idempotent); the body's rest, if any, is left to a plain read."""
        if self._finished:
            return
        self._finished = True
        if self._parser is not None and self._parser.sink is self:
            self._parser.sink = None
        content: Any = self._content
        if content._waiter is self:
            content._waiter = None
        content._low_water = self._low_water
        if isinstance(self._max_size, int):
            self._transport.max_size = self._max_size


def push_body(
    response: httpx.Response,
    on_data: Callable[[bytes], bool],
    on_end: Callable[[BaseException | None], None],
) -> PushedBody | None:
    """Deliver `response`'s body as it arrives: `on_data(bytes)` from the connection's receive
    callback (what has already arrived, at once, from here), until it returns False; then
    `on_end(None)` at the body's end, or `on_end(error)` when the connection fails (httpx's
    mapped error, as `read` raises it). Neither may raise. Returns the push, to `stop()` (the rest
    of the body is then for `body_reader`); None for a response of another transport (read it
    with `body_reader`)."""
    stream = response.stream
    if not isinstance(stream, _ResponseStream) or stream._failed is not None:
        return None
    content = stream._content
    if content._waiter is not None:
        raise RuntimeError("the response body is already being read")
    parser = getattr(content._protocol, "_parser", None)
    if isinstance(parser, RelayedBodyParser) and parser.decoding is content:
        waiter = PushedBody(content, stream._request_of, on_data, on_end, parser)
        waiter.attach()
        return waiter
    waiter = PushedBody(content, stream._request_of, on_data, on_end)
    if content._exception is not None:
        # What arrived before the failure, first.
        if not content._buffer or on_data(content._read_nowait(-1)):
            waiter.set_exception(content._exception)
    else:
        waiter.set_result(None)  # what already arrived, or the end; else waits for the next bytes
        protocol: Any = content._protocol
        if not waiter.done() and protocol._reading_paused:
            # What arrived before the push filled the reader past its high-water mark, so aiohttp
            # stopped reading; the reader would resume it once read below its low-water mark,
            # which pushes disable (see PushedBody). Here, outside the parser's callback, it is
            # safe to resume (its parser is fed what it held, so pushes may come from here).
            protocol.resume_reading()
    return waiter


def body_reader(response: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """A function returning the next raw bytes of `response`'s body (b"" at its end): the
    transport's own read for its responses, else one step of `aiter_raw()` (another transport,
    in tests)."""
    stream = response.stream
    if isinstance(stream, _ResponseStream):
        return stream.read
    chunks = response.aiter_raw()

    async def next_chunk() -> bytes:
        return await anext(chunks, b"")

    return next_chunk


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
            stream=_ResponseStream(response, request_of),
            extensions={"http_version": b"HTTP/1.1"},
        )


__all__ = ["body_reader", "push_body", "PushedBody", "WorkerTransport"]
