"""Message Batches survive their gateway: a process SIGKILLed mid-batch, then another started; two
processes claiming from one batch, one of them killed. Every item ends with exactly one result,
and none is run to completion twice (counted at the generation worker) when the kill lands in an
item's context phase or in its generation (the worker sees its client go and aborts).

The one window a kill can hit that runs an item twice to completion, between the generation
worker's last token and the result's write (docs/batches.md, "The window after the last token"),
is tested on its own: the result's write is held back by a lock the test takes, the gateway is
killed once the worker has completed the item, and the item runs again: one result, two
completions at the worker.

Written for SQLite and PostgreSQL alike (CI runs the suite on both): claims differ underneath
(`SKIP LOCKED` on PostgreSQL, serialized on SQLite), the outcome must not.
"""

from __future__ import annotations

import signal
import time
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
# Long enough that a running item is nearly always in its context phase, or in its generation
# before the first token: a kill then lands before the generation worker completed it.
PHASE_S = 2.5
SLOW = {"context": f"[sim context_delay={PHASE_S} tokens=2]", "generation": f"[sim gen_delay={PHASE_S} tokens=2]"}
# The kill lands while the oldest running item has at least this long left of its phase: the time
# the test takes to see the moment and kill is far less, even on a loaded machine. (Killed at the
# first moment every running item was in its phase, an item near its phase's end finished at the
# worker before the kill landed, and ran again: the window this test leaves out, hit by timing in a
# PostgreSQL run beside another suite.)
KILL_MARGIN_S = 1.0


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


def kill_mid_item(gateway: Gateway, cluster: Cluster, batch_id: str, done_before: int, phase: str) -> None:
    """SIGKILL the gateway once `done_before` items have results and every running item is in
    `phase` (`context`, or `generation` before its first token): none of them has been completed
    by the generation worker, or is being written (test_a_kill_after_the_last_token_runs_the_item_again
    is the window this leaves out)."""
    from messages_api.models import BatchItem

    items = BatchItem.objects.filter(batch__batch_id=batch_id)
    busy, idle = (cluster.context, cluster.generation) if phase == "context" else (cluster.generation, cluster.context)

    seen_at: list[float] = []  # when the test first saw each of the busy worker's requests
    received = busy.stats()["received"]

    def all_early_in_phase() -> bool:
        nonlocal received
        stats = busy.stats()
        now = time.monotonic()
        seen_at.extend([now] * (stats["received"] - received))
        received = stats["received"]
        running, active = items.filter(state="running").count(), stats["active"]
        if not (running > 0 and active == running and idle.stats()["active"] == 0 and len(seen_at) >= active):
            return False
        # The sim answers in arrival order: the oldest of the active requests is seen_at[-active].
        return now - seen_at[-active] < PHASE_S - KILL_MARGIN_S

    wait_until(lambda: items.filter(state="done").count() >= done_before, 60, 0.05)
    wait_until(all_early_in_phase, 60, 0.01, f"the running items were never all early in their {phase} phase")
    gateway.kill(signal.SIGKILL)


def assert_retaken(batch_id: str) -> None:
    """The killed process's items were claimed again (the kill landed mid-item)."""
    from messages_api.models import BatchItem

    assert BatchItem.objects.filter(batch__batch_id=batch_id, attempts__gte=2).exists()


def assert_each_item_once(results: list[Any], cluster: Cluster, in_the_window: int = 0) -> None:
    """One succeeded result per item, and one completion at the worker per item, plus those the
    kill caught in the crash window (`in_the_window`)."""
    assert sorted(r.custom_id for r in results) == sorted(f"i{n}" for n in range(ITEMS))
    assert all(r.result.type == "succeeded" for r in results), [r.result for r in results if r.result.type != "succeeded"]
    stats = cluster.generation.stats()
    assert stats["completed"] == ITEMS + in_the_window, stats


def caught_in_the_window(cluster: Cluster, batch_id: str) -> int:
    """After a kill, once the worker has seen the dead process's calls end: the items it completed
    whose results the dead process never wrote. The kill is timed to leave this window out
    (`kill_mid_item`), but a loaded machine can still land it there (one in a few runs beside
    another suite); such an item runs again by design (docs/batches.md), and counts here so that
    every other item must still have run exactly once."""
    from messages_api.models import BatchItem

    wait_until(lambda: cluster.generation.stats()["active"] == 0 and cluster.context.stats()["active"] == 0, 30, 0.05)
    done = BatchItem.objects.filter(batch__batch_id=batch_id, state="done").count()
    return cluster.generation.stats()["completed"] - done


@pytest.mark.parametrize("phase", ["context", "generation"])
def test_sigkill_mid_batch_then_restart(cluster: Cluster, started: list[Gateway], phase: str) -> None:
    first = start(started, cluster)
    with sdk_client(first.url, cluster.key) as client:
        batch = client.messages.batches.create(requests=[item(f"i{n}", f"item {n} {SLOW[phase]}", cluster.model) for n in range(ITEMS)])  # type: ignore[misc]
    kill_mid_item(first, cluster, batch.id, done_before=3, phase=phase)
    if phase == "generation":
        assert cluster.generation.stats()["completed"] < ITEMS
    in_the_window = caught_in_the_window(cluster, batch.id)
    assert 0 <= in_the_window <= 2, in_the_window  # at most the items running at the kill
    second = start(started, cluster)
    results = results_when_ended(second, cluster, batch.id)
    assert_each_item_once(results, cluster, in_the_window)
    assert_retaken(batch.id)
    from messages_api.models import MessageRequest

    # The killed process's attempts were closed by the recovery sweep, as any request of a dead process.
    assert not MessageRequest.objects.filter(batch_id=batch.id, status="in_progress").exists()


def test_two_processes_claim_from_one_batch_and_one_dies(cluster: Cluster, started: list[Gateway]) -> None:
    from messages_api.models import MessageRequest

    first, second = start(started, cluster), start(started, cluster)
    with sdk_client(first.url, cluster.key) as client:
        batch = client.messages.batches.create(requests=[item(f"i{n}", f"item {n} {SLOW['context']}", cluster.model) for n in range(ITEMS)])  # type: ignore[misc]
    # Both claim: each holds at most two items at once.
    wait_until(
        lambda: MessageRequest.objects.filter(batch_id=batch.id).values("gateway_instance").distinct().count() == 2,
        60, 0.05, "only one process ran items",
    )
    kill_mid_item(first, cluster, batch.id, done_before=4, phase="context")
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


def test_a_kill_after_the_last_token_runs_the_item_again(cluster: Cluster, started: list[Gateway]) -> None:
    """The window a crash leaves (docs/batches.md): the worker completed the item, the process dies
    before its result is written. Held here by a lock on the item's row (PostgreSQL's row lock,
    SQLite's write lock), so the kill lands in it every time. The item runs again: exactly one
    result, and two completions at the worker, as documented."""
    from django.db import connection, transaction

    if connection.vendor == "postgresql":
        # The lock cannot hold the process inside the window there: the result's UPDATE, already
        # sent and waiting for the row, commits once the lock goes, although its process was
        # killed meanwhile (the server sees its client gone only when it next writes to it). The
        # item then ran once (seen in a full PostgreSQL run); the window itself is SQLite's here.
        pytest.skip("on PostgreSQL a write already sent completes after its process is killed")

    from messages_api.models import BatchItem

    first = start(started, cluster)
    with sdk_client(first.url, cluster.key) as client:
        batch = client.messages.batches.create(requests=[item("only", f"the only item {SLOW['context']}", cluster.model)])  # type: ignore[misc]
    row = BatchItem.objects.filter(batch__batch_id=batch.id)
    wait_until(lambda: cluster.context.stats()["active"] == 1, 30, 0.01, "the item never reached its context phase")
    with transaction.atomic():
        list(row.select_for_update())  # the result's write waits behind this
        wait_until(lambda: cluster.generation.stats()["completed"] == 1, 30, 0.02, "the worker never completed the item")
        first.kill(signal.SIGKILL)
    second = start(started, cluster)
    results = results_when_ended(second, cluster, batch.id)
    assert [(r.custom_id, r.result.type) for r in results] == [("only", "succeeded")]
    assert cluster.generation.stats()["completed"] == 2  # run twice to completion: the window
    assert row.get().attempts == 2
