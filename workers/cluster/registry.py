"""The cluster as routing sees it: immutable snapshots of pools and endpoints, kept fresh from the
database so that no request queries it.

Each process reloads the (small) tables every `REGISTRY_REFRESH_INTERVAL_S` in a background task;
an operator's change in the admin or through `register_worker` therefore reaches every gateway
process within that interval plus one load, without a restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from django.db.models import Count

from disagg_project import GATEWAY_INSTANCE, DatabaseThread
from workers.models import ModelRoute, ModelRoutePool, Reservation, WorkerEndpoint, WorkerPool


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    id: int
    pool_name: str
    role: str
    url: str
    enabled: bool
    draining: bool
    healthy: bool
    # Operator-set, protocol-specific options (e.g. SGLang's `bootstrap_port`).
    options: Mapping[str, Any] = field(default_factory=dict)
    # Open reservations other gateway processes held at the last refresh (for least_loaded).
    remote_open: int = 0
    # Most requests / tokens in flight at once (None: unlimited); see workers.admission.
    capacity: int | None = None
    capacity_tokens: int | None = None
    # Where the engine publishes its KV-cache events, and its hash settings (`workers.kv_events`).
    kv_events_address: str = ""
    kv_events_replay_address: str = ""
    kv_events_topic: str = ""
    kv_block_size: int | None = None
    kv_hash_algorithm: str = ""
    kv_hash_seed: str = field(default="", repr=False)

    @property
    def capped(self) -> bool:
        return self.capacity is not None or self.capacity_tokens is not None


@dataclass(frozen=True, slots=True)
class PoolInfo:
    id: int
    name: str
    model: str
    schedule_style: str
    max_local_prefill_tokens: int
    routing: str
    protocol: str
    created_at: datetime
    # The shared secret signed handoffs use ("" when none): kept out of repr so it never reaches
    # a log line or a traceback.
    signing_key: str = field(default="", repr=False)
    endpoints: tuple[EndpointInfo, ...] = field(default_factory=tuple)
    #: Whose prompts a request may reuse from the workers' prefix caches (`CacheScope`).
    cache_scope: str = "key"

    def endpoints_for(self, role: str) -> tuple[EndpointInfo, ...]:
        return tuple(e for e in self.endpoints if e.role == role)


@dataclass(frozen=True, slots=True)
class RouteInfo:
    """A public model name (or pattern) and its pools in preference order."""

    name: str
    display_name: str
    upstream_model: str
    pool_ids: tuple[int, ...]
    created_at: datetime
    is_pattern: bool = False


@dataclass(frozen=True, slots=True)
class Served:
    """A pool that serves a public model name, and the name its workers know the model by."""

    pool: PoolInfo
    upstream_model: str


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    pools: tuple[PoolInfo, ...]
    loaded_at: float
    routes: tuple[RouteInfo, ...] = ()

    def pool_for_model(self, model: str) -> PoolInfo | None:
        served = self.serving(model)
        return served[0].pool if served else None

    def serving(self, model: str) -> tuple[Served, ...]:
        """The pools that serve `model`, in preference order: its exact route's, else the pool
        whose own model it is, else the most specific pattern route's (the longest pattern)."""
        by_id = {pool.id: pool for pool in self.pools}
        exact = next((r for r in self.routes if not r.is_pattern and r.name == model), None)
        if exact is not None:
            return _served(exact, by_id)
        own = tuple(Served(pool, pool.model) for pool in self.pools if pool.model == model)
        if own:
            return own
        patterns = [r for r in self.routes if r.is_pattern and fnmatchcase(model, r.name)]
        if patterns:
            return _served(max(patterns, key=lambda r: len(r.name)), by_id)
        return ()

    def public_models(self) -> list[tuple[str, str, datetime]]:
        """(name, display name, created) of every exact name a client may ask for: the exact
        routes, then the pools' own models, each once."""
        names: dict[str, tuple[str, str, datetime]] = {}
        for route in self.routes:
            if not route.is_pattern and route.pool_ids:
                names.setdefault(route.name, (route.name, route.display_name or route.name, route.created_at))
        for pool in self.pools:
            names.setdefault(pool.model, (pool.model, pool.model, pool.created_at))
        return list(names.values())


def _served(route: RouteInfo, by_id: Mapping[int, PoolInfo]) -> tuple[Served, ...]:
    return tuple(
        Served(by_id[pool_id], route.upstream_model or by_id[pool_id].model) for pool_id in route.pool_ids if pool_id in by_id
    )


def load_snapshot() -> ClusterSnapshot:
    """Read pools and endpoints (synchronous; run it off the event loop)."""
    endpoints_by_pool: dict[int, list[EndpointInfo]] = {}
    # Sorted here, not by the database (`order_by()` drops the models' default ordering):
    # compiling the ORDER BY clauses was a tenth of an idle process's CPU.
    pools = sorted(WorkerPool.objects.order_by(), key=lambda p: p.name)
    names = {p.id: p.name for p in pools}
    remote_open = dict(
        Reservation.objects.filter(released_at__isnull=True)
        .exclude(gateway_instance=GATEWAY_INSTANCE)
        .values_list("endpoint_id")
        .annotate(n=Count("id"))
    )
    for e in sorted(WorkerEndpoint.objects.order_by(), key=lambda e: e.id):
        endpoints_by_pool.setdefault(e.pool_id, []).append(
            EndpointInfo(
                id=e.id,
                pool_name=names.get(e.pool_id, ""),
                role=e.role,
                url=e.url.rstrip("/"),
                enabled=e.enabled,
                draining=e.draining,
                healthy=e.healthy,
                options=MappingProxyType(dict(e.options or {})),
                remote_open=remote_open.get(e.id, 0),
                capacity=e.capacity,
                capacity_tokens=e.capacity_tokens,
                kv_events_address=e.kv_events_address,
                kv_events_replay_address=e.kv_events_replay_address,
                kv_events_topic=e.kv_events_topic,
                kv_block_size=e.kv_block_size,
                kv_hash_algorithm=e.kv_hash_algorithm,
                kv_hash_seed=e.kv_hash_seed,
            )
        )
    places: dict[int, list[tuple[int, int]]] = {}
    for place in ModelRoutePool.objects.order_by().values("route_id", "pool_id", "position", "id"):
        places.setdefault(place["route_id"], []).append((place["position"] * 1_000_000 + place["id"], place["pool_id"]))
    routes = tuple(
        RouteInfo(
            name=r.name,
            display_name=r.display_name,
            upstream_model=r.upstream_model,
            pool_ids=tuple(pool_id for _, pool_id in sorted(places.get(r.id, ()))),
            created_at=r.created_at,
            is_pattern=r.is_pattern,
        )
        for r in sorted(ModelRoute.objects.order_by(), key=lambda r: r.id)
    )
    return ClusterSnapshot(
        routes=routes,
        pools=tuple(
            PoolInfo(
                id=p.id,
                name=p.name,
                model=p.model,
                schedule_style=p.schedule_style,
                max_local_prefill_tokens=p.max_local_prefill_tokens,
                routing=p.routing,
                protocol=p.protocol,
                created_at=p.created_at,
                signing_key=p.handoff_signing_key,
                endpoints=tuple(endpoints_by_pool.get(p.id, ())),
                cache_scope=p.cache_scope,
            )
            for p in pools
        ),
        loaded_at=time.monotonic(),
    )


# The reloads' own thread (see workers.cluster.db_thread).
_RELOADS = DatabaseThread("registry-db")


class Registry:
    """Holds the current snapshot for this process."""

    def __init__(self) -> None:
        self._snapshot: ClusterSnapshot | None = None
        self._first_load: asyncio.Lock | None = None

    async def snapshot(self) -> ClusterSnapshot:
        """The current snapshot (loaded on first use; `workers.cluster.services` keeps it fresh)."""
        if self._snapshot is None:
            if self._first_load is None:
                self._first_load = asyncio.Lock()
            async with self._first_load:
                if self._snapshot is None:
                    await self.refresh()
                    # Under daphne the services are already running (started with the loop, see
                    # `disagg_project.asgi`); under any other ASGI server the first request that
                    # needs the cluster starts them. Once per process, never per request.
                    from workers.cluster import services

                    services.start_services()
        assert self._snapshot is not None
        return self._snapshot

    def current(self) -> ClusterSnapshot | None:
        """The snapshot as it is, without loading (None before the first load)."""
        return self._snapshot

    async def refresh(self) -> ClusterSnapshot:
        # On its own thread: a reload must not queue behind other ORM work.
        self._snapshot = await _RELOADS.run(load_snapshot)
        return self._snapshot


_registry: Registry | None = None


def get_registry() -> Registry:
    global _registry
    if _registry is None:
        _registry = Registry()
    return _registry


__all__ = ["ClusterSnapshot", "EndpointInfo", "get_registry", "load_snapshot", "PoolInfo", "Registry"]
