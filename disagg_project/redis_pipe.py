"""One pipelined connection to Redis: commands go out as they come, without waiting for the
replies before them, and each reply goes to its caller in order (Redis answers a connection's
commands in the order it sent them). hiredis parses the replies.

    conn = await RedisPipe.connect("redis://127.0.0.1:6379/0", timeout=0.25, max_in_flight=256)
    reply = await conn.call(b"EVALSHA", sha, 2, key1, key2, arg)   # an error reply raises hiredis.ReplyError
    conn.send(on_reply, b"EVALSHA", ...)   # no await: on_reply(reply) gets the reply, an error reply or the failure
    conn.close()

Commands given in the same turn of the event loop leave in one write (the ones that end a request
and the next request's check, say). The connection is bounded twice: at most `max_in_flight`
commands await their replies (`call` waits for room; `send` says it has none), and a reply later
than `timeout` after its command was written closes the connection, since a reply cannot be
skipped in a pipelined stream. When the connection closes, for whatever reason, every command in
flight and every caller waiting for room fails at once with `ConnectionError` (`TimeoutError` for
a late reply); the connection is then done and its owner opens another.

Not thread-safe: a connection belongs to the event loop that opened it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import hiredis

ReplyError = hiredis.ReplyError
OnReply = Callable[[Any], None]


class RedisPipe(asyncio.Protocol):
    """A connection to Redis with any number of commands in flight, up to `max_in_flight`."""

    def __init__(self, timeout: float, max_in_flight: int) -> None:
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader()
        # The future or callback of each command given (waiting to leave or sent), in order.
        self._pending: deque[asyncio.Future[Any] | OnReply] = deque()
        # Commands written and replies read since the connection opened, and (commands written,
        # when) per write: a reply is late `timeout` after its command left, not after it was given.
        self._written = 0
        self._replied = 0
        self._writes: deque[tuple[int, float]] = deque()
        self._late = -1
        # Callers waiting for room, and those woken that have not written yet.
        self._room: deque[asyncio.Future[None]] = deque()
        self._woken = 0
        self._out: list[bytes] = []
        self._watchdog: asyncio.TimerHandle | None = None
        self.failure: Exception | None = None

    @classmethod
    async def connect(cls, url: str, *, timeout: float, max_in_flight: int) -> RedisPipe:
        """Open a connection (`redis://`, `rediss://` or `unix://`, with the URL's user, password
        and database). Raises `ConnectionError`, or `TimeoutError` past `timeout`."""
        target = parse_url(url)
        loop = asyncio.get_running_loop()
        pipe = cls(timeout, max_in_flight)
        try:
            async with asyncio.timeout(timeout):
                if target.path:
                    await loop.create_unix_connection(lambda: pipe, target.path)
                else:
                    await loop.create_connection(lambda: pipe, target.host, target.port, ssl=target.ssl)
                if target.password is not None:
                    await pipe.call(b"AUTH", *((target.username,) if target.username else ()), target.password)
                if target.db:
                    await pipe.call(b"SELECT", target.db)
        except BaseException as exc:
            pipe.close()
            if isinstance(exc, ReplyError):
                raise ConnectionError(f"Redis refused the connection's set-up: {exc}") from exc
            if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
                raise ConnectionError(f"cannot connect to Redis: {exc}") from exc
            raise
        return pipe

    @property
    def closed(self) -> bool:
        return self.failure is not None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply; raises `ReplyError` for an error reply,
        `ConnectionError` or `TimeoutError` when the connection fails first."""
        if len(self._pending) + self._woken >= self.max_in_flight or self._room:
            await self._wait_for_room()
        future: asyncio.Future[Any] = self._loop.create_future()
        self._write(future, args)
        reply = await future
        if type(reply) is ReplyError:
            raise reply
        return reply

    def send(self, on_reply: OnReply, *args: Any) -> bool:
        """Send one command without waiting: `on_reply` gets its reply, a `ReplyError` or the
        connection's failure. False (and nothing sent) while `max_in_flight` commands await
        theirs or callers wait for room."""
        if len(self._pending) + self._woken >= self.max_in_flight or self._room:
            return False
        self._write(on_reply, args)
        return True

    async def _wait_for_room(self) -> None:
        """Wait, first come first served, until a reply makes room for one more command."""
        if self.failure is not None:
            raise self.failure
        room: asyncio.Future[None] = self._loop.create_future()
        self._room.append(room)
        try:
            await room
        except asyncio.CancelledError:
            if room.cancelled():
                self._room.remove(room)
            elif room.exception() is None:  # given room it will not use: pass it on
                self._woken -= 1
                self._wake()
            raise
        self._woken -= 1

    def _write(self, waiter: asyncio.Future[Any] | OnReply, args: tuple[Any, ...]) -> None:
        if self.failure is not None:
            _deliver(waiter, self.failure)
            return
        self._pending.append(waiter)
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(hiredis.pack_command(args))

    def _flush(self) -> None:
        out = self._out
        if not out or self._transport is None or self.failure is not None:
            return
        self._transport.write(b"".join(out) if len(out) > 1 else out[0])
        self._written += len(out)
        out.clear()
        now = self._loop.time()
        self._writes.append((self._written, now))
        if self._watchdog is None:
            self._watchdog = self._loop.call_at(now + self.timeout, self._check_deadline)

    def _check_deadline(self) -> None:
        self._watchdog = None
        writes = self._writes
        while writes and writes[0][0] <= self._replied:
            writes.popleft()
        if not writes or self.failure is not None:
            return
        now = self._loop.time()
        deadline = writes[0][1] + self.timeout
        if now < deadline:
            self._watchdog = self._loop.call_at(deadline, self._check_deadline)
        elif self._late != writes[0][0]:
            # Late only if still unanswered once the loop has read its socket again: this check
            # may run in the same turn as the write, after a long one, before any read.
            self._late = writes[0][0]
            self._watchdog = self._loop.call_at(now, self._check_deadline)
        else:
            self._abort(TimeoutError(f"Redis did not answer within {self.timeout:g} s"))

    def _wake(self) -> None:
        free = self.max_in_flight - len(self._pending) - self._woken
        while free > 0 and self._room:
            room = self._room.popleft()
            room.set_result(None)
            self._woken += 1
            free -= 1

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        pending = self._pending
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:
                self._abort(ConnectionError(f"unreadable reply from Redis: {exc}"))
                return
            if reply is False:
                break
            if not pending:
                self._abort(ConnectionError("a reply from Redis that no command awaits"))
                return
            self._replied += 1
            _deliver(pending.popleft(), reply)
        if self._room:
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"Redis closed the connection ({exc})" if exc else "Redis closed the connection"))

    # --- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; commands in flight fail with `ConnectionError`."""
        self._abort(ConnectionError("the connection to Redis was closed"))

    def _abort(self, failure: Exception) -> None:
        self._fail(failure)
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, failure: Exception) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._out.clear()
        while self._pending:
            _deliver(self._pending.popleft(), failure)
        while self._room:
            self._room.popleft().set_exception(failure)


def _deliver(waiter: asyncio.Future[Any] | OnReply, reply: Any) -> None:
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():  # its caller was cancelled: the reply goes nowhere
            if isinstance(reply, Exception) and type(reply) is not ReplyError:
                waiter.set_exception(reply)
            else:
                waiter.set_result(reply)
    else:
        waiter(reply)


class Target:
    """Where a Redis URL points and how to log in."""

    __slots__ = ("host", "port", "path", "ssl", "username", "password", "db")

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, path: str = "", ssl: ssl.SSLContext | None = None,
                 username: str | None = None, password: str | None = None, db: int = 0) -> None:
        self.host, self.port, self.path, self.ssl = host, port, path, ssl
        self.username, self.password, self.db = username, password, db


def parse_url(url: str) -> Target:
    """`redis://[[user]:password@]host[:port][/db]`, `rediss://…` (TLS) or `unix://[[user]:password@]/path[?db=N]`,
    as redis-py reads them. Raises `ValueError` for another scheme."""
    parts = urlparse(url)
    query = parse_qs(parts.query)
    target = Target(
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )
    db = query.get("db", [""])[0]
    if parts.scheme == "unix":
        target.path = unquote(parts.path)
    elif parts.scheme in ("redis", "rediss"):
        target.host = unquote(parts.hostname or "127.0.0.1")
        target.port = parts.port or 6379
        db = db or parts.path.lstrip("/")
        if parts.scheme == "rediss":
            target.ssl = ssl.create_default_context()
            if query.get("ssl_cert_reqs", [""])[0] == "none":
                target.ssl.check_hostname = False
                target.ssl.verify_mode = ssl.CERT_NONE
    else:
        raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {url}")
    target.db = int(db) if db else 0
    return target
