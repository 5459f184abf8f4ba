"""Message Batches survive their gateway: a process SIGKILLed mid-batch, then another started; two
processes claiming from one batch, one of them killed. Every item ends with exactly one result,
and none is run to completion twice (counted at the generation worker).

Written for SQLite and PostgreSQL alike (CI runs the suite on both): claims differ underneath
(`SKIP LOCKED` on PostgreSQL, serialized on SQLite), the outcome must not.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.batches import BATCH_ENV, item
from tests.support.cluster import Cluster, register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.sdk import sdk_client
from tests.support.simworkers import SimWorker

# Fast recovery: a dead process is seen within a heartbeat (its PID is gone), leases are short.
DURABLE_ENV = {**BATCH_ENV, "GATEWAY_HEARTBEAT_INTERVAL_S": "0.3", "BATCH_LEASE_S": "6", "BATCH_MAX_IN_FLIGHT": "2", "BATCH_CLAIM_SIZE": "2"}
ITEMS = 8
# Long enough that a running item is nearly always in its context phase: a kill then lands
# before the generation worker completed anything of it.
SLOW = "[sim context_delay=1.5 tokens=2]"


@pytest.fixture
def cluster(transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker) -> Cluster:
    return register_cluster(context_worker, generation_worker)


@pytest.fixture
def started(django_db_blocker: Any) -> Iterator[list[Gateway]]:
    gateways: list[Gateway] = []
    yield gateways
    for gateway in gateways:
        gateway.stop()


def start(started: list[Gateway], cluster: Cluster) -> Gateway:
    gateway = Gateway(DURABLE_ENV).start()
    started.append(gateway)
    wait_registered(gateway, cluster)
    return gateway


def results_when_ended(gateway: Gateway, cluster: Cluster, batch_id: str) -> list[Any]:
    with sdk_client(gateway.url, cluster.key) as client:
        wait_until(lambda: client.messages.batches.retrieve(batch_id).processing_status == "ended", 60, 0.2, "the batch never ended")
        return list(client.messages.batches.results(batch_id))


def kill_mid_item(gateway: Gateway, cluster: Cluster, batch_id: str, done_before: int) -> None:
    """SIGKILL the gateway once `done_before` items have results and every running item is in its
    context phase: none of them has been completed by the generation worker, or is being written
    (a kill between a worker's last token and the result's write runs that item again: the one
    window a crash leaves, docs/batches.md)."""
    from messages_api.models import BatchItem

    items = BatchItem.objects.filter(batch__batch_id=batch_id)

    def all_in_context() -> bool:
        running = items.filter(state="running").count()
        return running > 0 and cluster.context.stats()["active"] == running and cluster.generation.stats()["active"] == 0

    wait_until(lambda: items.filter(state="done").count() >= done_before, 60, 0.05)
    wait_until(all_in_context, 30, 0.01, "the running items were never all in their context phase")
    gateway.kill(signal.SIGKILL)


def assert_retaken(batch_id: str) -> None:
    """The killed process's items were claimed again (the kill landed mid-item)."""
    from messages_api.models import BatchItem

    assert BatchItem.objects.filter(batch__batch_id=batch_id, attempts__gte=2).exists()


def assert_each_item_once(results: list[Any], cluster: Cluster) -> None:
    assert sorted(r.custom_id for r in results) == sorted(f"i{n}" for n in range(ITEMS))
    assert all(r.result.type == "succeeded" for r in results), [r.result for r in results if r.result.type != "succeeded"]
    stats = cluster.generation.stats()
    assert stats["completed"] == ITEMS, stats


def test_sigkill_mid_batch_then_restart(cluster: Cluster, started: list[Gateway]) -> None:
    first = start(started, cluster)
    with sdk_client(first.url, cluster.key) as client:
        batch = client.messages.batches.create(requests=[item(f"i{n}", f"item {n} {SLOW}", cluster.model) for n in range(ITEMS)])  # type: ignore[misc]
    kill_mid_item(first, cluster, batch.id, done_before=3)
    second = start(started, cluster)
    results = results_when_ended(second, cluster, batch.id)
    assert_each_item_once(results, cluster)
    assert_retaken(batch.id)
    from messages_api.models import MessageRequest

    # The killed process's attempts were closed by the recovery sweep, as any request of a dead process.
    assert not MessageRequest.objects.filter(batch_id=batch.id, status="in_progress").exists()


def test_two_processes_claim_from_one_batch_and_one_dies(cluster: Cluster, started: list[Gateway]) -> None:
    from messages_api.models import MessageRequest

    first, second = start(started, cluster), start(started, cluster)
    with sdk_client(first.url, cluster.key) as client:
        batch = client.messages.batches.create(requests=[item(f"i{n}", f"item {n} {SLOW}", cluster.model) for n in range(ITEMS)])  # type: ignore[misc]
    # Both claim: each holds at most two items at once.
    wait_until(
        lambda: MessageRequest.objects.filter(batch_id=batch.id).values("gateway_instance").distinct().count() == 2,
        60, 0.05, "only one process ran items",
    )
    kill_mid_item(first, cluster, batch.id, done_before=4)
    results = results_when_ended(second, cluster, batch.id)
    assert_each_item_once(results, cluster)
    assert_retaken(batch.id)


def test_results_of_an_item_are_written_once(cluster: Cluster, started: list[Gateway]) -> None:
    """Retrieve and results repeated while the batch runs and after change nothing: the counts
    are final once, the lines are the same each time."""
    gateway = start(started, cluster)
    with sdk_client(gateway.url, cluster.key) as client:
        batch = client.messages.batches.create(requests=[item(f"i{n}", f"item {n} [sim tokens=1]", cluster.model) for n in range(ITEMS)])  # type: ignore[misc]
        first = results_when_ended(gateway, cluster, batch.id)
        again = list(client.messages.batches.results(batch.id))
    assert [r.model_dump() for r in first] == [r.model_dump() for r in again]
    assert_each_item_once(first, cluster)
