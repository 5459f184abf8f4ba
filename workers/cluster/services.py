"""The background work of a gateway process: registry refresh, health probes, the engines' load
(`workers.cluster.engine_load`), heartbeat and recovery of dead processes' rows, the KV-cache event subscriptions
(`workers.kv_events`), and (with Redis)
the renewal of the leases it holds there.

They are started in one place per server: daphne has no ASGI lifespan, so `disagg_project.asgi`
starts them on daphne's event loop as soon as the application is loaded, before any request.
Under another ASGI server the registry's first load (the first request that needs the cluster)
starts them instead (`Registry.snapshot`). One set per event loop; each loop iteration is guarded
so a failure is logged and retried, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from django.conf import settings

from disagg_project import DatabaseThread
from disagg_project import shared_leases as leases
from workers.admission.queue import notify_freed
from workers.cluster import recovery
from workers.cluster.engine_load import engine_loads
from workers.cluster.health import health
from workers.cluster.registry import get_registry
from workers.kv_events.subscriber import kv_events
from workers.routing import fallback

logger = logging.getLogger(__name__)

_started: dict[asyncio.AbstractEventLoop, list[asyncio.Task[None]]] = {}


def start_services() -> None:
    """Start the services on the running loop unless they run already."""
    loop = asyncio.get_running_loop()
    if loop in _started:
        return
    for stale in [other for other in _started if other.is_closed()]:
        del _started[stale]
    _started[loop] = [
        loop.create_task(_every(settings.REGISTRY_REFRESH_INTERVAL_S, get_registry().refresh), name="registry-refresh"),
        loop.create_task(_every(settings.HEALTH_CHECK_INTERVAL_S, _probe), name="health-probe"),
        loop.create_task(_every(settings.GATEWAY_HEARTBEAT_INTERVAL_S, _heartbeat_and_recover, first_delay=0), name="heartbeat"),
    ]
    if settings.ENGINE_LOAD_POLL_S > 0:
        _started[loop].append(
            loop.create_task(_every(settings.ENGINE_LOAD_POLL_S, _poll_engine_load, first_delay=0), name="engine-load")
        )
    if settings.REDIS_URL:
        _started[loop].append(loop.create_task(_every(settings.CAPACITY_LEASE_S / 3, leases.renew), name="lease-renewal"))
    if settings.KV_EVENTS_CHECK_S > 0:
        _started[loop].append(loop.create_task(_every(settings.KV_EVENTS_CHECK_S, _follow_kv_events, first_delay=0), name="kv-events"))


# The heartbeat's and the sweep's own thread (see workers.cluster.db_thread).
_RECOVERY = DatabaseThread("recovery-db")


async def _heartbeat_and_recover() -> None:
    await _RECOVERY.run(recovery.heartbeat)
    await _RECOVERY.run(recovery.sweep, settings.GATEWAY_DEAD_AFTER_S)


async def _poll_engine_load() -> None:
    """Read the engines' load; where an engine stopped holding admission (its queue cleared, its
    figures went stale), the requests waiting for its pool's role try again now, not at the next
    release of a slot."""
    for resource in await engine_loads.poll_all():
        notify_freed(resource)


async def _probe() -> None:
    await health.probe_all()
    # Off the request path: whether roles routed despite their probes pass them again.
    fallback.review()


_synced_at: list[float] = [-1.0]  # the registry load the subscriptions were last matched to


async def _follow_kv_events() -> None:
    """Subscribe to the endpoints that publish KV-cache events (on their own thread), and check
    them. Nothing to do while the registry has not changed and no endpoint publishes."""
    snapshot = get_registry().current()
    if snapshot is None:
        snapshot = await get_registry().snapshot()
    if snapshot.loaded_at != _synced_at[0]:
        _synced_at[0] = snapshot.loaded_at
        kv_events.sync(e for pool in snapshot.pools for e in pool.endpoints)
    if kv_events.view:
        kv_events.check()


async def _every(interval: float, work: Callable[[], Awaitable[object]], first_delay: float | None = None) -> None:
    await asyncio.sleep(interval if first_delay is None else first_delay)
    while True:
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("background %s failed; retrying", getattr(work, "__qualname__", work))
        await asyncio.sleep(interval)
