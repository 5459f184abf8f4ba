"""A finished request is freed the moment it ends, by reference counting: nothing it made is left
in a reference cycle for the garbage collector to find later.

One cycle through the consumer (consumer -> heartbeat -> its bound `_send_ping` -> consumer) once
kept every request's objects (~90: the consumer, its audit record, the pipeline, the worker's
response and reader) alive until a collection found them. Under load those objects outlived the
young generations, so they piled up until a full collection walked them all, a 20-30 ms stall of
the event loop that showed in the paced relay's token gaps. The gateway's Prometheus metrics
count what its collector frees (`python_gc_objects_collected_total`, prometheus_client's own), so
a real daphne process tells on itself.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, register_cluster, wait_registered
from tests.gateway import Gateway
from tests.rawclient import RawStream
from tests.simworkers import SimWorker

REQUESTS = 40  # of each kind below


def objects_collected(gateway: Gateway) -> float:
    """What the gateway's cyclic garbage collector has freed so far, all generations."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "python_gc_objects_collected_total"
    )


@pytest.fixture
def aggregated_cluster(transactional_db: Any, gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker) -> Cluster:
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    return cluster


def test_finished_requests_leave_nothing_for_the_garbage_collector(gateway: Gateway, aggregated_cluster: Cluster) -> None:
    cluster = aggregated_cluster
    body = {"model": cluster.model, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi [sim tokens=8]"}]}
    with httpx.Client(timeout=30) as client:
        client.post(gateway.url + "/v1/messages", json=body, headers=cluster.headers()).raise_for_status()  # warm
        before = objects_collected(gateway)
        for _ in range(REQUESTS):
            stream = RawStream.post_json(gateway.url + "/v1/messages", {**body, "stream": True}, cluster.headers())
            events = [frame.event for frame in stream.read_all()]
            assert stream.status == 200 and events[-1] == "message_stop", events
            answer = client.post(gateway.url + "/v1/messages", json=body, headers=cluster.headers())
            assert answer.status_code == 200, answer.text
            rejected = client.post(gateway.url + "/v1/messages", json={**body, "max_tokens": -1}, headers=cluster.headers())
            assert rejected.status_code == 400, rejected.text
    collected = objects_collected(gateway) - before
    # With the cycle, these requests left 3,400-3,700 objects to the collector (~90 per stream).
    # Without it, 150-230: what Django itself leaves in cycles for each request it serves (the
    # request and its messages storage, ~100 objects), here the /metrics and /ready calls around
    # the measurement, which the collector may free within it.
    assert collected < 25 * REQUESTS, f"{collected:.0f} objects freed by the cyclic collector over {3 * REQUESTS} requests"
