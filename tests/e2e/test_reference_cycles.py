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

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster import register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker

STREAMS = 100
OTHERS = 20  # non-streamed, and rejected


def objects_collected(gateway: Gateway) -> float:
    """What the gateway's cyclic garbage collector has freed so far, all generations."""
    from tests.support.prometheus import metric_total

    return metric_total(httpx.get(gateway.url + "/metrics", timeout=10).text, "python_gc_objects_collected_total")


@pytest.fixture
def fresh_gateway(transactional_db: Any) -> Iterator[Gateway]:
    """A gateway of this test's own: the collector counts whatever it frees, and a gateway that
    served earlier tests holds their garbage (cancelled requests, Django's) for a later collection
    to free in the middle of this one's measurement (seen in CI: 3,028 objects)."""
    gateway = Gateway({}).start()
    try:
        yield gateway
    finally:
        gateway.stop()


def test_finished_requests_leave_nothing_for_the_garbage_collector(
    fresh_gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    gateway = fresh_gateway
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    body = {"model": cluster.model, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi [sim tokens=8]"}]}
    with httpx.Client(timeout=30) as client:
        client.post(gateway.url + "/v1/messages", json=body, headers=cluster.headers()).raise_for_status()  # warm
        before = objects_collected(gateway)
        for _ in range(STREAMS):
            stream = RawStream.post_json(gateway.url + "/v1/messages", {**body, "stream": True}, cluster.headers())
            events = [frame.event for frame in stream.read_all()]
            assert stream.status == 200 and events[-1] == "message_stop", events
        for _ in range(OTHERS):
            answer = client.post(gateway.url + "/v1/messages", json=body, headers=cluster.headers())
            assert answer.status_code == 200, answer.text
            rejected = client.post(gateway.url + "/v1/messages", json={**body, "max_tokens": -1}, headers=cluster.headers())
            assert rejected.status_code == 400, rejected.text
    collected = objects_collected(gateway) - before
    # With the cycle, each stream left ~90 objects to the collector (these requests: ~9,000).
    # Without it, a few hundred: what Django itself leaves in cycles for each request it serves
    # (the request and its messages storage, ~100 objects), here the /ready and /metrics calls
    # around the measurement, which the collector may free within it.
    assert collected < 15 * STREAMS, f"{collected:.0f} objects freed by the cyclic collector over {STREAMS + 2 * OTHERS} requests"
