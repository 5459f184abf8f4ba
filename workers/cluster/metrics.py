"""Prometheus metrics of the cluster side: retries, requests routed despite their endpoints'
probes, open reservations, duplicate releases, breaker state, and the engines' own load as this process knows it (`workers.cluster.engine_load`):
their queues, KV use, whether the figures are fresh enough to route on, and the reads made here;
and what their KV-cache events say they hold (`workers.kv_events`).

Gauges that mirror in-memory state are read at scrape time by a collector, so the hot path never
touches them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from workers.cluster.engine_load import engine_loads
from workers.cluster.health import BreakerState, health
from workers.cluster.registry import get_registry
from workers.kv_events.subscriber import kv_events
from workers.routing.reservations import ledger

worker_retries = Counter(
    "gateway_worker_retries", "Worker requests retried on another endpoint, by stage.", ["stage"]
)

routed_despite_probes = Counter(
    "gateway_routed_despite_probes",
    "Requests routed to endpoints whose health probes get no answer in time, their role having no other (workers.routing.fallback).",
    ["pool", "role"],
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
        labelled = ["pool", "role", "endpoint"]
        waiting = GaugeMetricFamily("gateway_engine_requests_waiting", "Requests queued in the engine, as it last reported.", labels=labelled)
        running = GaugeMetricFamily("gateway_engine_requests_running", "Requests the engine runs, as it last reported.", labels=labelled)
        kv_usage = GaugeMetricFamily("gateway_engine_kv_usage", "Fraction of the engine's KV cache in use, as it last reported.", labels=labelled)
        fresh = GaugeMetricFamily(
            "gateway_engine_load_fresh",
            "1 while the engine's figures are fresh enough to route on; 0: routing uses the gateway's own counts.",
            labels=labelled,
        )
        age = GaugeMetricFamily("gateway_engine_load_age_seconds", "Age of the engine's last figures this process has.", labels=labelled)
        holds = GaugeMetricFamily(
            "gateway_engine_load_holds_admission",
            "1 while the engine's fresh figures count the endpoint as full (ENGINE_LOAD_ADMIT_MAX_*): requests wait in the gateway's queue.",
            labels=labelled,
        )
        polls = CounterMetricFamily(
            "gateway_engine_load_polls", "Reads of the engine's metrics made by this process, by outcome.", labels=[*labelled, "outcome"]
        )
        kv_blocks = GaugeMetricFamily(
            "gateway_kv_events_blocks", "Blocks the engine's KV-cache events say it holds, as this process follows them.", labels=labelled
        )
        kv_trusted = GaugeMetricFamily(
            "gateway_kv_events_trusted",
            "1 while routing trusts the engine's KV-cache events; 0: the approximate prefix index (see the reason).",
            labels=[*labelled, "reason"],
        )
        kv_counts = CounterMetricFamily(
            "gateway_kv_events_blocks_applied", "Blocks stored and removed by the engine's events, and hashes checked.", labels=[*labelled, "kind"]
        )
        snapshot = get_registry().current()
        for pool in snapshot.pools if snapshot else ():
            for endpoint in pool.endpoints:
                labels = [pool.name, endpoint.role, endpoint.url]
                open_reservations.add_metric(labels, ledger.open_count(endpoint.id))
                breaker.add_metric(labels, _BREAKER_VALUE[health.breaker_state(endpoint.id)])
                healthy.add_metric(labels, 1 if health.usable(endpoint) else 0)
                reported = engine_loads.view.get(endpoint.id)
                if reported is not None:
                    waiting.add_metric(labels, reported.load.waiting)
                    running.add_metric(labels, reported.load.running)
                    if reported.load.kv_usage is not None:
                        kv_usage.add_metric(labels, reported.load.kv_usage)
                    fresh.add_metric(labels, 1 if reported.fresh else 0)
                    age.add_metric(labels, reported.age_s)
                    holds.add_metric(labels, 1 if engine_loads.holds(endpoint.id) else 0)
                for outcome, n in engine_loads.polls.get(endpoint.id, {}).items():
                    polls.add_metric([*labels, outcome], n)
                blocks = kv_events.view.get(endpoint.id)
                if blocks is not None:
                    kv_blocks.add_metric(labels, blocks.size)
                    kv_trusted.add_metric([*labels, blocks.fallback], 0 if blocks.fallback else 1)
                    for kind, n in (("stored", blocks.stored), ("removed", blocks.removed), ("checked", blocks.checked)):
                        kv_counts.add_metric([*labels, kind], n)
        yield open_reservations
        yield breaker
        yield healthy
        yield from (waiting, running, kv_usage, fresh, age, holds, polls, kv_blocks, kv_trusted, kv_counts)
        yield CounterMetricFamily(
            "gateway_kv_events_prompts_learned",
            "Prompts whose token ids a worker returned, hashed into block keys (the join of conversations to KV-cache events).",
            value=kv_events.prompts_learned,
        )
        yield CounterMetricFamily(
            "gateway_kv_events_prompts_received",
            "Prompts learned by other gateway processes and kept here from the shared Redis stream (REDIS_URL).",
            value=kv_events.prompts_received,
        )
        yield CounterMetricFamily(
            "gateway_duplicate_releases",
            "Releases of a reservation that was already released (each is released once; above 0 is a bug).",
            value=ledger.duplicate_releases,
        )


REGISTRY.register(ClusterCollector())
