"""The load generator's lean raw HTTP/1.1 client: keep-alive connections on asyncio protocols
that time every response (and, on request, its SSE frames or a byte pattern in its body)."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Any

from tests.support.chunked import ChunkedDecoder


@dataclass(slots=True)
class Response:
    """One response as the client saw it. Times are `time.perf_counter()` values."""

    sent_at: float = 0.0
    status_at: float | None = None
    status: int = 0
    headers: bytes = b""
    done_at: float | None = None
    body: bytearray | None = None  # kept only when asked for
    frames: list[tuple[float, bytes]] | None = None  # (arrival, event name) when asked for
    count: int = 0  # occurrences of the counted pattern in the body
    first_count_at: float | None = None  # arrival of the first occurrence
    count_times: list[float] | None = None  # arrival of every read holding occurrences, when asked
    max_count_gap: float = 0.0  # longest time between two reads holding occurrences
    error: str | None = None


class HttpConnection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection that sends one request at a time.

    Parsing is minimal on purpose (the load generator shares 2 cores with the system under test):
    the status line, the two framing headers, and a chunked or Content-Length body. Per response
    it can keep the body, split it into SSE frames (event name and arrival time), or only count a
    byte pattern (e.g. `event: content_block_delta`) and note when it first arrived.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._buf = b""
        self._resp: Response | None = None
        self._future: asyncio.Future[Response] | None = None
        self._state = 0  # 0 head, 1 content-length body, 2 chunked body
        self._remaining = 0
        self._decoder = ChunkedDecoder()
        self._keep_body = False
        self._frames = False
        self._sse = b""
        self._pattern = b""
        self._tail = b""
        self._last_count_at = 0.0
        self.server_closes = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self._future is not None and not self._future.done():
            resp = self._resp
            assert resp is not None
            # A Content-Length-less, non-chunked body ends with the connection.
            if resp.status and self._state == 1 and self._remaining < 0:
                resp.done_at = time.perf_counter()
                self._future.set_result(resp)
            else:
                resp.error = f"connection lost ({exc or 'closed by server'}) in state {self._state}"
                self._future.set_result(resp)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        resp = self._resp
        if resp is None:
            return
        if resp.status_at is None:
            resp.status_at = now
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos = 0
        n = len(buf)
        while pos < n:
            state = self._state
            if state == 2:  # chunked body (the product's decoder: per read as cheap as a hand-written one)
                payload = self._decoder.feed(buf[pos:] if pos else buf)
                pos = n
                if payload:
                    self._on_body(payload, now)
                if self._decoder.done:
                    self._finish(now)  # nothing may follow an unpipelined response
                continue
            if state == 1:  # content-length body
                if self._remaining < 0:  # read until close
                    self._on_body(buf[pos:], now)
                    pos = n
                    continue
                take = min(self._remaining, n - pos)
                self._on_body(buf[pos : pos + take], now)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._finish(now)
                    pos = n
                continue
            # state 0: head
            end = buf.find(b"\r\n\r\n", pos)
            if end < 0:
                break
            head = buf[pos:end]
            pos = end + 4
            resp.status = int(head[9:12])
            lower = head.lower()
            resp.headers = head
            self.server_closes = b"\r\nconnection: close" in lower
            if b"\r\ntransfer-encoding: chunked" in lower:
                self._state = 2
                self._decoder = ChunkedDecoder()
            else:
                i = lower.find(b"\r\ncontent-length:")
                if i >= 0:
                    j = lower.find(b"\r\n", i + 2)
                    self._remaining = int(lower[i + 17 : j if j >= 0 else len(lower)].strip())
                    self._state = 1
                    if self._remaining == 0:
                        self._finish(now)
                        pos = n
                else:
                    self._remaining = -1
                    self._state = 1
        if pos < n:
            self._buf = buf[pos:]

    # body handling

    def _on_body(self, data: bytes, now: float) -> None:
        resp = self._resp
        assert resp is not None
        if self._keep_body:
            assert resp.body is not None
            resp.body += data
        if self._pattern:
            text = self._tail + data if self._tail else data
            found = text.count(self._pattern)
            if found:
                if resp.first_count_at is None:
                    resp.first_count_at = now
                else:
                    gap = now - self._last_count_at
                    if gap > resp.max_count_gap:
                        resp.max_count_gap = gap
                self._last_count_at = now
                if resp.count_times is not None:
                    resp.count_times.extend((now,) * found)
                resp.count += found
            keep = len(self._pattern) - 1
            # Keep a tail so a pattern split across two reads is still seen (once).
            self._tail = text[-keep:] if len(text) >= keep else text
        if self._frames:
            assert resp.frames is not None
            sse = self._sse + data if self._sse else data
            start = 0
            while True:
                end = sse.find(b"\n\n", start)
                if end < 0:
                    break
                frame = sse[start:end]
                start = end + 2
                name = b""
                if frame.startswith(b"event: "):
                    nl = frame.find(b"\n")
                    name = frame[7 : nl if nl >= 0 else len(frame)]
                elif frame.startswith(b"data: "):
                    name = b"data"
                elif frame.startswith(b":"):
                    name = b"comment"
                resp.frames.append((now, name))
            self._sse = sse[start:]

    def _finish(self, now: float) -> None:
        resp = self._resp
        assert resp is not None and self._future is not None
        resp.done_at = now
        self._resp = None
        future, self._future = self._future, None
        if not future.done():
            future.set_result(resp)
        if self.server_closes and self.transport is not None:
            self.transport.close()

    # API

    def request(
        self, wire: bytes, *, keep_body: bool = False, frames: bool = False, count: bytes = b"", count_times: bool = False
    ) -> asyncio.Future[Response]:
        """Send one request; the future resolves with its Response when the body is complete."""
        assert self._future is None, "one request at a time"
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._future = loop.create_future()
        resp = Response(
            body=bytearray() if keep_body else None, frames=[] if frames else None, count_times=[] if count_times else None
        )
        self._resp = resp
        self._state = 0
        self._buf = b""
        self._sse = b""
        self._tail = b""
        self._keep_body = keep_body
        self._frames = frames
        self._pattern = count
        resp.sent_at = time.perf_counter()
        self.transport.write(wire)
        return self._future

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self.server_closes

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(port: int, host: str = "127.0.0.1") -> HttpConnection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(HttpConnection, host, port)
    return protocol


class KeepAlive:
    """One reusable connection to a port, reconnecting when the server closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: HttpConnection | None = None

    async def request(self, wire: bytes, **kwargs: Any) -> Response:
        if self.conn is None or not self.conn.usable:
            if self.conn is not None:
                self.conn.close()
            self.conn = await connect(self.port)
        return await self.conn.request(wire, **kwargs)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
