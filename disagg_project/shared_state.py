"""State every gateway process shares through Redis (`REDIS_URL`): per-key limits and budgets,
per-key concurrency, endpoint capacity.

Each check is one Lua script, so it is atomic and costs one round trip. Without `REDIS_URL` (the
embedded default `make run` uses) there is nothing to call and each caller keeps the same state
in this process instead. When Redis stops answering, callers fall back to that per-process state
too: the first failure is logged, every fallen-back call is counted
(`gateway_shared_state_fallbacks_total`), and Redis is tried again `REDIS_RETRY_S` later. A Redis
outage therefore loosens limits to per-process ones; it never fails a request.

    shared = get_shared_state()
    result = await shared.run(SCRIPT, keys, args)   # None: use the per-process state
    shared.spawn(SCRIPT, keys, args)                 # fire and forget (releases)
    entries = await shared.read_stream(key, after, count=256, block_s=1.0)   # a stream as it grows

Each event loop has one pipelined connection (`redis_pipe.RedisPipe`): every script of the loop's
requests shares it, and those given in the same turn of the loop leave in one write. redis-py's
pooled client cost ~96 µs of CPU per script awaited here, this ~30 (bench/shared_state_cpu.py).
A blocking stream read (`read_stream`) holds its connection until an entry comes: it has one of
its own per loop.

`SharedState(url, serves=...)` names what falls back in the log line of a failure: the process's
one instance (`get_shared_state`) serves limits and capacity; a background user on a thread of
its own (`workers.kv_events.shared`) keeps an instance of its own there, so that the two threads
share no connection, task or set.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

from django.conf import settings
from prometheus_client import Counter, Gauge

from disagg_project.redis_pipe import RedisPipe, ReplyError

logger = logging.getLogger(__name__)

fallbacks = Counter(
    "gateway_shared_state_fallbacks",
    "Checks of shared state (limits, capacity) answered from this process's own state because Redis failed, by reason.",
    ["reason"],
)
redis_up = Gauge("gateway_shared_state_up", "1 while Redis answers (REDIS_URL set), 0 while this process falls back.")


class Script:
    """A Lua script, run by its SHA (EVALSHA); when Redis does not have it (first use, a restart)
    it is sent whole once (EVAL, which loads it)."""

    __slots__ = ("source", "sha")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


class SharedState:
    """The Redis connection of this process (one per event loop), or none."""

    def __init__(self, url: str, *, serves: str = "limits and capacity") -> None:
        self.url = url
        self.serves = serves
        self._pipes: dict[asyncio.AbstractEventLoop, RedisPipe] = {}
        # Per loop: the connection of blocking stream reads (`read_stream`).
        self._readers: dict[asyncio.AbstractEventLoop, RedisPipe] = {}
        self._connecting: dict[asyncio.AbstractEventLoop, asyncio.Task[RedisPipe]] = {}
        self._down_until = 0.0
        self._up = False
        # Background calls that could not be written at once (no connection yet, or no room).
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def configured(self) -> bool:
        return bool(self.url)

    @property
    def available(self) -> bool:
        """Configured and not in a fallback pause: whether a call will try Redis now."""
        return bool(self.url) and time.monotonic() >= self._down_until

    async def run(self, script: Script, keys: list[str], args: list[Any]) -> Any | None:
        """The script's result, or None when the caller must use its per-process state."""
        if not self.url:
            return None
        if time.monotonic() < self._down_until:
            fallbacks.labels("unavailable").inc()
            return None
        try:
            pipe = self._pipes.get(asyncio.get_running_loop())
            if pipe is None or pipe.failure is not None:
                pipe = await self._connect()
            try:
                result = await pipe.call(b"EVALSHA", script.sha, len(keys), *keys, *args)
            except ReplyError as exc:
                if not str(exc).startswith("NOSCRIPT"):
                    raise
                result = await pipe.call(b"EVAL", script.source, len(keys), *keys, *args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a Redis outage must never fail a request
            self._fail(exc)
            return None
        if not self._up:
            self._answered()
        return result

    async def read_stream(self, key: str, after: bytes, *, count: int, block_s: float) -> list[tuple[bytes, list[Any]]] | None:
        """Up to `count` entries of the stream `key` after the entry id `after` (b"0-0": from its
        start), each as (id, [field, value, ...]), waiting up to `block_s` for the first: [] when
        none came. None when the caller must do without (as `run`: not configured, or failing).
        On a connection of the loop's own for blocking reads (one reader per loop at a time)."""
        if not self.url:
            return None
        if time.monotonic() < self._down_until:
            return None
        loop = asyncio.get_running_loop()
        try:
            reader = self._readers.get(loop)
            if reader is None or reader.failure is not None:
                reader = self._readers[loop] = await RedisPipe.connect(
                    self.url, timeout=block_s + settings.REDIS_TIMEOUT_S, max_in_flight=1
                )
            reply = await reader.call(b"XREAD", b"COUNT", count, b"BLOCK", max(1, int(block_s * 1000)), b"STREAMS", key, after)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # as `run`: a Redis outage is a fallback, never an error
            self._fail(exc)
            return None
        if not self._up:
            self._answered()
        if not reply:
            return []  # BLOCK timed out
        try:
            return [(entry[0], entry[1]) for entry in reply[0][1]]
        except (IndexError, TypeError):
            self._fail(ConnectionError(f"an XREAD reply of an unexpected shape: {reply!r:.200}"))
            return None

    def spawn(self, script: Script, keys: list[str], args: list[Any]) -> None:
        """Run the script in the background (a release must not wait for Redis); written with
        the loop's next batch of commands, without a task of its own unless the connection is
        full or not open yet."""
        if not self.url:
            return
        if time.monotonic() < self._down_until:
            fallbacks.labels("unavailable").inc()
            return
        if not self._send(b"EVALSHA", script, keys, args):
            self._track(self.run(script, keys, args))

    def _send(self, command: bytes, script: Script, keys: list[str], args: list[Any]) -> bool:
        pipe = self._pipes.get(asyncio.get_running_loop())
        return pipe is not None and pipe.failure is None and pipe.send(
            lambda reply: self._background_reply(reply, script, keys, args),
            command, script.sha if command == b"EVALSHA" else script.source, len(keys), *keys, *args,
        )

    def _background_reply(self, reply: Any, script: Script, keys: list[str], args: list[Any]) -> None:
        if isinstance(reply, Exception):
            if type(reply) is ReplyError and str(reply).startswith("NOSCRIPT"):
                if not self._send(b"EVAL", script, keys, args):
                    self._track(self.run(script, keys, args))
            else:
                self._fail(reply)
        elif not self._up:
            self._answered()

    def _track(self, call: Any) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _connect(self) -> RedisPipe:
        """The loop's connection, opened once however many calls wait for it."""
        loop = asyncio.get_running_loop()
        connecting = self._connecting.get(loop)
        if connecting is None:
            for stale in [other for other in self._pipes if other.is_closed()]:
                del self._pipes[stale]
            connecting = self._connecting[loop] = loop.create_task(
                RedisPipe.connect(self.url, timeout=settings.REDIS_TIMEOUT_S, max_in_flight=settings.REDIS_MAX_IN_FLIGHT)
            )
            connecting.add_done_callback(lambda task: self._connected(loop, task))
        return await asyncio.shield(connecting)

    def _connected(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[RedisPipe]) -> None:
        del self._connecting[loop]
        if not task.cancelled() and task.exception() is None:
            self._pipes[loop] = task.result()

    def _answered(self) -> None:
        self._up = True
        redis_up.set(1)
        if self._down_until:
            self._down_until = 0.0
            logger.warning("Redis at %s answers again: %s are shared again", _safe(self.url), self.serves)

    def _fail(self, exc: Exception) -> None:
        fallbacks.labels(type(exc).__name__).inc()
        self._up = False
        redis_up.set(0)
        if not self._down_until:
            logger.warning(
                "Redis at %s failed (%s: %s): %s fall back to this process's own state; retrying in %.0f s",
                _safe(self.url), type(exc).__name__, exc, self.serves, settings.REDIS_RETRY_S,
            )
        self._down_until = time.monotonic() + settings.REDIS_RETRY_S

    async def drain(self) -> None:
        """Wait until every call this loop made in the background has its answer."""
        loop = asyncio.get_running_loop()
        while True:
            if mine := [task for task in self._background if task.get_loop() is loop]:
                await asyncio.gather(*mine, return_exceptions=True)
                continue
            pipe = self._pipes.get(loop)
            if pipe is None or pipe.failure is not None or not pipe.in_flight:
                return
            try:
                await pipe.call(b"PING")  # answered after everything written before it
            except Exception:
                return

    async def aclose(self) -> None:
        """Close this loop's connection once what it sent in the background is answered."""
        await self.drain()
        loop = asyncio.get_running_loop()
        for pipes in (self._pipes, self._readers):
            pipe = pipes.pop(loop, None)
            if pipe is not None:
                pipe.close()


def _safe(url: str) -> str:
    """The URL without its password, for the log."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest


# KEYS: sorted sets of leases; ARGV: expiry, the keys' time to live (ms), then each key's leases
# followed by ''
_RENEW = Script(
    """
local key = 1
for i = 3, #ARGV do
  if ARGV[i] == '' then
    key = key + 1
  else
    redis.call('ZADD', KEYS[key], 'XX', ARGV[1], ARGV[i])
  end
end
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return 1
"""
)


class LeaseBook:
    """Leases this process holds in Redis sorted sets (member: the lease, score: its expiry).

    A lease expires `LEASE_S` after it was last renewed, so what a process that died held frees
    itself; the living renew theirs every third of that (`renew`, a background service). Endpoint
    slots and per-key concurrency are both such leases."""

    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}

    def hold(self, key: str, lease: str) -> None:
        self._held.setdefault(key, set()).add(lease)

    def drop(self, key: str, lease: str) -> bool:
        """Forget a lease; False when it was not held here."""
        leases = self._held.get(key)
        if leases is None or lease not in leases:
            return False
        leases.discard(lease)
        if not leases:
            del self._held[key]
        return True

    def __len__(self) -> int:
        return sum(len(leases) for leases in self._held.values())

    async def renew(self) -> None:
        if not self._held:
            return
        lease_s = settings.CAPACITY_LEASE_S
        keys: list[str] = []
        args: list[Any] = [time.time() + lease_s, int(lease_s * 1000)]
        for key, leases in list(self._held.items()):
            keys.append(key)
            args.extend(leases)
            args.append("")
        await get_shared_state().run(_RENEW, keys, args)


leases = LeaseBook()


def lease_expiry() -> float:
    return time.time() + settings.CAPACITY_LEASE_S


_shared: SharedState | None = None


def get_shared_state() -> SharedState:
    global _shared
    if _shared is None or _shared.url != settings.REDIS_URL:
        _shared = SharedState(settings.REDIS_URL)
    return _shared
