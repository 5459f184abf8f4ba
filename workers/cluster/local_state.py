"""What this process alone knows of the cluster, for the admin's cluster overview: each endpoint's
breaker, this process's own health probe, the reservations it holds, its engine's load as last
reported (`workers.cluster.engine_load`), what its KV-cache events say it holds
(`workers.kv_events`), and the requests waiting in its admission queues.

Every gateway process keeps these in memory, so the process that serves an admin page can speak
only for itself; the database holds what every process shares (endpoint health as last written,
open reservation rows, the audit). Safe to call from any thread: it only reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg_project import GATEWAY_INSTANCE
from workers.admission.queue import Priority, waiting_here
from workers.cluster.engine_load import EndpointLoad, engine_loads
from workers.cluster.health import health
from workers.cluster.registry import get_registry
from workers.kv_events.subscriber import kv_events
from workers.routing.reservations import ledger


@dataclass(frozen=True, slots=True)
class EndpointHere:
    #: "closed", "open" or "half_open"
    breaker: str
    #: This process's probe verdict, None before it has probed the endpoint.
    probed_healthy: bool | None
    probe_error: str
    #: Reservations this process holds on the endpoint, and their tokens.
    open_here: int
    tokens_here: int
    #: The engine's own figures as this process last had them (None: none read), and why this
    #: process's last read of them failed ("" when it did not).
    engine: EndpointLoad | None = None
    engine_error: str = ""
    #: The engine's KV-cache events as this process follows them (`KvEvents.summary`; None: the
    #: endpoint has no KV-event address).
    kv_events: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class LocalState:
    instance: str
    endpoints: Mapping[int, EndpointHere]
    #: Requests waiting for a slot here, by (pool name, role, priority label).
    queued: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    #: Seconds since this process last loaded pools and endpoints (None: never).
    registry_age_s: float | None = None

    def queued_in(self, pool: str, role: str | None = None) -> dict[str, int]:
        """Waiting requests of a pool (and role) by priority label, every class listed."""
        counts = {p.label: 0 for p in Priority}
        for (pool_name, of_role, label), n in self.queued.items():
            if pool_name == pool and (role is None or of_role == role):
                counts[label] += n
        return counts


def local_state(endpoint_ids: Iterable[int]) -> LocalState:
    """This process's view of the given endpoints and of its admission queues."""
    now = time.monotonic()
    endpoints = {}
    for endpoint_id in endpoint_ids:
        probe = health.probes.get(endpoint_id)
        probed = probe is not None and probe.last_checked_at > 0
        endpoints[endpoint_id] = EndpointHere(
            breaker=health.breaker_state(endpoint_id),
            probed_healthy=probe.healthy if probe is not None and probed else None,
            probe_error=probe.last_error if probe is not None and probed else "",
            open_here=ledger.open_count(endpoint_id),
            tokens_here=ledger.tokens(endpoint_id),
            engine=engine_loads.view.get(endpoint_id),
            engine_error=engine_loads.error(endpoint_id),
            kv_events=kv_events.summary(endpoint_id),
        )
    queued: dict[tuple[str, str, str], int] = {}
    for (resource, priority), n in waiting_here().items():
        if isinstance(resource, tuple) and len(resource) == 2:
            key = (str(resource[0]), str(resource[1]), priority.label)
            queued[key] = queued.get(key, 0) + n
    snapshot = get_registry().current()
    return LocalState(
        instance=GATEWAY_INSTANCE,
        endpoints=endpoints,
        queued=queued,
        registry_age_s=None if snapshot is None else max(0.0, now - snapshot.loaded_at),
    )
