"""Prometheus metrics of the cluster side: retries, open reservations, duplicate releases,
breaker state.

Gauges that mirror in-memory state are read at scrape time by a collector, so the hot path never
touches them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from workers.cluster.health import BreakerState, health
from workers.cluster.registry import get_registry
from workers.routing.reservations import ledger

worker_retries = Counter(
    "gateway_worker_retries", "Worker requests retried on another endpoint, by stage.", ["stage"]
)

_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class ClusterCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        open_reservations = GaugeMetricFamily(
            "gateway_open_reservations", "Reservations this process holds, by endpoint.", labels=["pool", "role", "endpoint"]
        )
        breaker = GaugeMetricFamily(
            "gateway_breaker_state", "Circuit breaker per endpoint: 0 closed, 1 half-open, 2 open.", labels=["pool", "role", "endpoint"]
        )
        healthy = GaugeMetricFamily(
            "gateway_endpoint_healthy", "1 when the endpoint may take new requests here.", labels=["pool", "role", "endpoint"]
        )
        snapshot = get_registry().current()
        for pool in snapshot.pools if snapshot else ():
            for endpoint in pool.endpoints:
                labels = [pool.name, endpoint.role, endpoint.url]
                open_reservations.add_metric(labels, ledger.open_count(endpoint.id))
                breaker.add_metric(labels, _BREAKER_VALUE[health.breaker_state(endpoint.id)])
                healthy.add_metric(labels, 1 if health.usable(endpoint) else 0)
        yield open_reservations
        yield breaker
        yield healthy
        yield CounterMetricFamily(
            "gateway_duplicate_releases",
            "Releases of a reservation that was already released (each is released once; above 0 is a bug).",
            value=ledger.duplicate_releases,
        )


REGISTRY.register(ClusterCollector())
