"""An httpx transport for calls to workers: HTTP/1.1 keep-alive connections on asyncio protocols,
responses parsed by httptools (llhttp, in C).

    transport = WorkerTransport(max_connections=4096, keepalive_expiry=4.0)
    response = await transport.handle_async_request(httpx.Request("POST", url, content=body))
    async for chunk in response.aiter_raw(): ...
    await response.aclose()     # back to the pool if the answer was read whole, else closed

Why not httpcore, httpx's default transport: on this gateway's hot path it took half of the
event loop's CPU (py-spy on bench/nonstream_rps.py): anyio cancel scopes around every read,
h11's pure-Python parser, a pool that scans all of its connections on every request and release,
and a `select()` on every reused connection. This transport does only what worker calls need:
plain or TLS HTTP/1.1 to a few origins, one request per connection at a time, request bodies in
memory, response bodies streamed. It learns that a server closed an idle connection from the
event loop (`connection_lost`), so reuse needs no system call.

Failures are httpx's own exceptions (`ConnectError`, `ConnectTimeout`, `PoolTimeout`,
`ReadTimeout`, `ReadError`, `RemoteProtocolError`), with the request attached, so callers map
them as they would httpcore's.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator

import httptools
import httpx

Origin = tuple[bytes, str, int]

# Above this many unread response bytes the connection stops reading from its socket until the
# consumer catches up (TCP then pushes back on the worker): a slow client never makes the gateway
# buffer a whole answer.
READ_HIGH_WATER = 256 * 1024
# Request bodies up to this size are joined to the head and leave in one write.
SMALL_BODY = 64 * 1024


class _HeadTooLarge(Exception):
    """Raised inside a parser callback: httptools turns it into HttpParserCallbackError."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: at most one request at a time, the response parsed as it
    arrives. The asyncio protocol and the httptools callbacks both live here."""

    def __init__(self, pool: _OriginPool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self._max_headers = pool.transport.max_response_headers
        self._max_head_bytes = pool.transport.max_response_header_bytes
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.counted = False  # holds one of the pool's open slots (set once connected)
        self.idle_since = 0.0
        self._reading_paused = False
        self._reset_response()

    def _reset_response(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # Over every head of this response, interim 1xx ones included:
        self._header_count = 0
        self._header_bytes = 0  # of the header fields parsed
        self._unparsed_head_bytes = 0  # of the reads that left a head incomplete
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received_any = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._ends_at_eof = False
        self._error: type[httpx.TransportError] | None = None
        self._error_message = ""

    # --- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._fail(httpx.RemoteProtocolError, str(exc.__context__))
            else:
                self._fail(httpx.RemoteProtocolError, "the server sent a malformed HTTP response")
            self.close()
            return
        if not self.headers_done:
            # Every byte of this read belongs to a head still incomplete (httptools keeps a partial
            # header line to itself, so `on_header` alone cannot bound one endless line).
            self._unparsed_head_bytes += len(data)
            if self._unparsed_head_bytes > self._max_head_bytes:
                self._fail(httpx.RemoteProtocolError, f"the response head exceeds {self._max_head_bytes} bytes")
                self.close()

    def eof_received(self) -> bool:
        return False  # let the transport close; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._transport = None
        if self.headers_done and not self.complete and self._ends_at_eof:
            self.complete = True  # a body delimited by the end of the connection
        elif not self.complete:
            self._fail(httpx.ReadError if exc is not None else httpx.RemoteProtocolError, "the server closed the connection")
        if self.counted:
            self.counted = False
            self._pool.connection_closed()
        self._wake()

    # --- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4  # "name: value\r\n"
        if self._header_count > self._max_headers:
            raise _HeadTooLarge(f"the response has more than {self._max_headers} header fields")
        if self._header_bytes > self._max_head_bytes:
            raise _HeadTooLarge(f"the response head exceeds {self._max_head_bytes} bytes")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self.headers = []  # an interim answer (100 Continue); the real one follows
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        names = {name.lower() for name, _ in self.headers}
        self._ends_at_eof = b"content-length" not in names and b"transfer-encoding" not in names
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_HIGH_WATER and not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return  # the end of an interim answer
        self.complete = True
        self._wake()

    # --- used by the transport ----------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        self._reset_response()
        transport = self._transport
        if transport is None or transport.is_closing():
            self._fail(httpx.RemoteProtocolError, "the server closed the connection")
            return
        if len(body) <= SMALL_BODY:
            transport.write(head + body)
        else:
            transport.write(head)
            transport.write(body)

    async def wait_headers(self, timeout: float | None) -> None:
        while not self.headers_done:
            self._raise_if_failed()
            await self._wait(timeout, "waiting for the response headers")

    async def read(self, timeout: float | None) -> bytes:
        """The body bytes that arrived since the last read; b"" once the body is complete."""
        while True:
            if self._chunks:
                chunks = self._chunks
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._reading_paused and self._transport is not None:
                    self._reading_paused = False
                    self._transport.resume_reading()
                return chunk
            if self.complete:
                return b""
            self._raise_if_failed()
            await self._wait(timeout, "reading the response body")

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self.closed = True
            self._transport.close()  # connection_lost follows and gives back the pool slot

    # --- internals ------------------------------------------------------------------------------

    def _fail(self, error: type[httpx.TransportError], message: str) -> None:
        if self._error is None:
            self._error, self._error_message = error, message
        self._wake()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error(self._error_message)

    async def _wait(self, timeout: float | None, what: str) -> None:
        waiter = self._waiter = self._loop.create_future()
        timer = None if timeout is None else self._loop.call_later(timeout, _time_out, waiter, what)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _time_out(waiter: asyncio.Future[None], what: str) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(f"timed out {what}"))


class _OriginPool:
    """The connections to one origin: idle ones on a stack (the most recently used is reused
    first; the oldest are pruned from the bottom), and a bound on how many are open."""

    def __init__(self, origin: Origin, transport: WorkerTransport) -> None:
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport = transport
        self._idle: collections.deque[_Connection] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.open = 0

    async def acquire(self, connect_timeout: float | None, pool_timeout: float | None) -> tuple[_Connection, bool]:
        """A connection for one request, and whether it was reused."""
        while True:
            self._prune(self.loop.time())  # what is left is younger than the expiry
            while self._idle:
                connection = self._idle.pop()
                if not connection.closed:
                    return connection, True
            if self.open < self.transport.max_connections:
                break
            await self._wait_for_slot(pool_timeout)
        self.open += 1
        try:
            connection = await self._connect(connect_timeout)
        except BaseException:
            self.connection_closed()
            raise
        if connection.closed:
            self.connection_closed()  # the server hung up at once; sending will say so
        else:
            connection.counted = True
        return connection, False

    async def _connect(self, timeout: float | None) -> _Connection:
        scheme, host, port = self.origin
        tls = self.transport.ssl_context if scheme == b"https" else None
        try:
            async with asyncio.timeout(timeout):
                _, connection = await self.loop.create_connection(
                    lambda: _Connection(self), host, port, ssl=tls, server_hostname=host if tls else None
                )
        except TimeoutError:
            raise httpx.ConnectTimeout("timed out connecting to the server") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"could not connect to the server ({type(exc).__name__})") from None
        return connection

    def release(self, connection: _Connection) -> None:
        """A connection whose response was read whole: keep it for the next request."""
        if connection.closed or not connection.keep_alive or len(self._idle) >= self.transport.max_keepalive_connections:
            connection.close()
            return
        connection.idle_since = self.loop.time()
        self._idle.append(connection)
        self._notify_one()

    def connection_closed(self) -> None:
        self.open -= 1
        self._notify_one()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def _prune(self, now: float) -> None:
        expiry = self.transport.keepalive_expiry
        idle = self._idle
        while idle and (idle[0].closed or now - idle[0].idle_since >= expiry):
            idle.popleft().close()

    async def _wait_for_slot(self, timeout: float | None) -> None:
        waiter = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            raise httpx.PoolTimeout("timed out waiting for a connection to the server") from None
        finally:
            if not waiter.done():
                waiter.cancel()

    def _notify_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, connection: _Connection, pool: _OriginPool, read_timeout: float | None) -> None:
        self._connection = connection
        self._pool = pool
        self._read_timeout = read_timeout
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read, timeout = self._connection.read, self._read_timeout
        while chunk := await read(timeout):
            yield chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        if connection.complete and not connection.closed:
            self._pool.release(connection)
        else:
            connection.close()  # a half-read answer: closing is how the worker learns to stop


class WorkerTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to workers; one instance per event loop (its pools belong to that loop)."""

    def __init__(
        self,
        *,
        max_connections: int = 4096,
        max_keepalive_connections: int = 512,
        keepalive_expiry: float = 4.0,
        max_response_headers: int = 100,
        max_response_header_bytes: int = 64 * 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections  # per origin
        self.max_keepalive_connections = max_keepalive_connections  # per origin
        self.keepalive_expiry = keepalive_expiry
        self.max_response_headers = max_response_headers
        self.max_response_header_bytes = max_response_header_bytes
        self._ssl_context = ssl_context
        self._pools: dict[Origin, _OriginPool] = {}

    @property
    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()  # loads the CA bundle: only when needed
        return self._ssl_context

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.raw_scheme
        if scheme not in (b"http", b"https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {scheme.decode()!r}", request=request)
        if request.method == "HEAD":
            raise httpx.UnsupportedProtocol("HEAD requests are not supported by this transport", request=request)
        origin = (scheme, url.host, url.port or (443 if scheme == b"https" else 80))
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _OriginPool(origin, self)
        timeouts = request.extensions.get("timeout") or {}
        body = request.content  # in memory: worker calls never stream a request body
        head = _request_head(request)
        try:
            for attempt in (1, 2):
                connection, reused = await pool.acquire(timeouts.get("connect"), timeouts.get("pool"))
                try:
                    connection.send(head, body)
                    await connection.wait_headers(timeouts.get("read"))
                    break
                except httpx.TimeoutException:
                    connection.close()
                    raise
                except httpx.TransportError:
                    connection.close()
                    # A kept-alive connection the server closed as we reused it: the request never
                    # reached it, so it goes out once more on a fresh connection.
                    if reused and attempt == 1 and not connection.received_any:
                        continue
                    raise
                except BaseException:
                    connection.close()
                    raise
        except httpx.TransportError as exc:
            exc.request = request
            raise
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=_ResponseStream(connection, pool, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _request_head(request: httpx.Request) -> bytes:
    lines = [request.method.encode(), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


__all__ = ["WorkerTransport"]
