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
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from django.conf import settings
from prometheus_client import Counter, Gauge

logger = logging.getLogger(__name__)

fallbacks = Counter(
    "gateway_shared_state_fallbacks",
    "Checks of shared state (limits, capacity) answered from this process's own state because Redis failed, by reason.",
    ["reason"],
)
redis_up = Gauge("gateway_shared_state_up", "1 while Redis answers (REDIS_URL set), 0 while this process falls back.")


class Script:
    """A Lua script run by its SHA (EVALSHA), loaded on first use and again after a Redis restart."""

    __slots__ = ("source", "_sha")

    def __init__(self, source: str) -> None:
        self.source = source
        self._sha: str | None = None

    async def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        from redis.exceptions import NoScriptError

        if self._sha is None:
            self._sha = await client.script_load(self.source)
        try:
            return await client.evalsha(self._sha, len(keys), *keys, *args)
        except NoScriptError:
            self._sha = await client.script_load(self.source)
            return await client.evalsha(self._sha, len(keys), *keys, *args)


class SharedState:
    """The Redis connection of this process (one client per event loop), or none."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._clients: dict[asyncio.AbstractEventLoop, Any] = {}
        self._down_until = 0.0
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def configured(self) -> bool:
        return bool(self.url)

    @property
    def available(self) -> bool:
        """Configured and not in a fallback pause: whether a call will try Redis now."""
        return bool(self.url) and time.monotonic() >= self._down_until

    def _client(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            import redis.asyncio

            for stale in [l for l in self._clients if l.is_closed()]:
                del self._clients[stale]
            timeout = settings.REDIS_TIMEOUT_S
            # A blocking pool: a burst of checks waits (up to the timeout) for one of
            # REDIS_MAX_CONNECTIONS connections instead of failing past redis-py's default 100,
            # which sent a whole process to its fallback for REDIS_RETRY_S (bench/tenants.py).
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                self.url, max_connections=settings.REDIS_MAX_CONNECTIONS, timeout=timeout,
                socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=30,
            )
            client = self._clients[loop] = redis.asyncio.Redis(connection_pool=pool)
        return client

    async def run(self, script: Script, keys: list[str], args: list[Any]) -> Any | None:
        """The script's result, or None when the caller must use its per-process state."""
        if not self.url:
            return None
        if time.monotonic() < self._down_until:
            fallbacks.labels("unavailable").inc()
            return None
        try:
            result = await script(self._client(), keys, args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a Redis outage must never fail a request
            self._fail(exc)
            return None
        if self._down_until:
            self._down_until = 0.0
            logger.warning("Redis at %s answers again: limits and capacity are shared again", _safe(self.url))
        redis_up.set(1)
        return result

    def spawn(self, script: Script, keys: list[str], args: list[Any]) -> None:
        """Run the script in the background (a release must not wait for Redis)."""
        if not self.url:
            return
        task = asyncio.get_running_loop().create_task(self.run(script, keys, args))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _fail(self, exc: Exception) -> None:
        fallbacks.labels(type(exc).__name__).inc()
        redis_up.set(0)
        if not self._down_until:
            logger.warning(
                "Redis at %s failed (%s: %s): limits and capacity fall back to this process's own state; retrying in %.0f s",
                _safe(self.url), type(exc).__name__, exc, settings.REDIS_RETRY_S,
            )
        self._down_until = time.monotonic() + settings.REDIS_RETRY_S

    async def aclose(self) -> None:
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
            await client.connection_pool.disconnect()  # a pool given to the client is not its to close


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
