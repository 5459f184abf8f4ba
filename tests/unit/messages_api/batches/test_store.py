"""The batches' rows through their state transitions (messages_api/batches/store.py): claims and
their fence, cancellation, expiry, leases given back, the end of a batch, paging, archiving; and
the PostgreSQL claim's SQL shape (CI runs the suite on PostgreSQL; here it is compiled, not run)."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import orjson
import pytest
from django.db import connection, transaction
from django.db.backends.postgresql.base import DatabaseWrapper as PostgresWrapper

from messages_api.auth import create_api_key
from messages_api.batches import store
from messages_api.batches.schema import ItemSpec, PageQuery
from messages_api.errors import AnthropicError
from messages_api.models import BatchItem, MessageBatch

pytestmark = pytest.mark.django_db

ME, OTHER = "host:1:me", "host:2:other"


def new_batch(items: int = 3, key: Any = None) -> tuple[Any, store.BatchView]:
    if key is None:
        key, _ = create_api_key(f"k{MessageBatch.objects.count()}-{items}")
    specs = [ItemSpec(f"i{n}", orjson.dumps({"n": n})) for n in range(items)]
    return key, store.create_batch(key.pk, key.name, specs)


def test_create_and_get_belong_to_the_key() -> None:
    key, batch = new_batch()
    other, _ = create_api_key("other")
    assert store.get_batch(key.pk, batch.batch_id) == batch
    assert store.get_batch(other.pk, batch.batch_id) is None
    assert batch.total == 3 and batch.processing_status == "in_progress"
    assert list(BatchItem.objects.filter(batch__batch_id=batch.batch_id).order_by("position").values_list("custom_id", "position", "state")) == [
        ("i0", 0, "queued"), ("i1", 1, "queued"), ("i2", 2, "queued"),
    ]


def test_claim_fence_and_finish_ends_the_batch() -> None:
    key, batch = new_batch(2)
    claimed = store.claim(ME, 10, 60)
    assert [c.custom_id for c in claimed] == ["i0", "i1"] and all(c.attempt == 1 for c in claimed)
    assert claimed[0].params == b'{"n":0}' and claimed[0].key_hash == key.key_hash
    assert store.claim(OTHER, 10, 60) == []  # nothing left to claim
    first, second = claimed
    assert not store.finish(OTHER, first, "succeeded", '{"type":"succeeded"}', "req_1")  # not the holder
    assert store.finish(ME, first, "succeeded", '{"type":"succeeded"}', "req_1")
    assert not store.finish(ME, first, "errored", "{}", "req_2")  # written once
    assert store.get_batch(key.pk, batch.batch_id).processing_status == "in_progress"  # type: ignore[union-attr]
    assert store.finish(ME, second, "errored", '{"type":"errored"}', "req_3")
    done = store.get_batch(key.pk, batch.batch_id)
    assert done is not None and done.processing_status == "ended" and done.ended_at is not None
    assert (done.succeeded, done.errored, done.canceled, done.expired) == (1, 1, 0, 0)
    assert store.results_chunk(store.results_batch(key.pk, batch.batch_id)[0], 0, 10)[0][1:] == ("i0", '{"type":"succeeded"}')  # type: ignore[index]


def test_requeue_backoff_and_a_stale_claim() -> None:
    new_batch(1)
    (item,) = store.claim(ME, 1, 60)
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    assert store.requeue(ME, item, later, "req_1")
    assert store.claim(ME, 1, 60) == []  # not before its backoff
    BatchItem.objects.update(not_before=datetime.now(timezone.utc))
    (again,) = store.claim(OTHER, 1, 60)
    assert again.attempt == 2
    # The first claim is stale: it may neither write nor give back nor renew.
    assert not store.finish(ME, item, "succeeded", "{}", "req_x")
    assert not store.requeue(ME, item, later, "req_x")
    assert store.renew(ME, {item.pk: item.attempt}, 60) == set()
    assert store.renew(OTHER, {again.pk: again.attempt}, 60) == {again.pk}


def test_leases_of_dead_processes_and_expired_leases_go_back() -> None:
    new_batch(2)
    first, second = store.claim(ME, 2, 60)
    assert store.release_instances([ME]) == 2
    reclaimed = store.claim(OTHER, 2, 0.0)  # a lease that expires at once
    assert [c.attempt for c in reclaimed] == [2, 2]
    swept = store.sweep(lease_grace_s=0.0)
    assert swept.released == 2 and swept.queued == 2 and swept.running == 0


def test_cancel_waiting_items_and_end_when_the_running_one_finishes() -> None:
    key, batch = new_batch(3)
    (running,) = store.claim(ME, 1, 60)
    canceling = store.cancel_batch(key.pk, batch.batch_id)
    assert canceling is not None and canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    assert store.claim(ME, 5, 60) == []  # nothing starts after the cancellation
    assert store.finish(ME, running, "succeeded", "{}", "req_1")
    done = store.get_batch(key.pk, batch.batch_id)
    assert done is not None and done.processing_status == "ended" and (done.succeeded, done.canceled) == (1, 2)
    again = store.cancel_batch(key.pk, batch.batch_id)
    assert again is not None and again.processing_status == "ended"  # an ended batch is answered as it is


def test_a_requeued_item_of_a_canceling_batch_is_canceled_by_the_sweep() -> None:
    key, batch = new_batch(1)
    (item,) = store.claim(ME, 1, 60)
    store.cancel_batch(key.pk, batch.batch_id)
    assert store.requeue(ME, item, datetime.now(timezone.utc), "req_1")  # refused for load after the cancel
    assert store.sweep(30).ended == [batch.batch_id]
    done = store.get_batch(key.pk, batch.batch_id)
    assert done is not None and done.canceled == 1


def test_expiry_ends_queued_and_running_items() -> None:
    key, batch = new_batch(3)
    (running,) = store.claim(ME, 1, 60)
    MessageBatch.objects.update(expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    swept = store.sweep(30)
    assert swept.expired == 3 and swept.ended == [batch.batch_id]
    assert not store.finish(ME, running, "succeeded", "{}", "req_1")  # its lease went with the expiry
    done = store.get_batch(key.pk, batch.batch_id)
    assert done is not None and done.expired == 3 and done.processing_status == "ended"


def test_delete_only_once_ended() -> None:
    key, batch = new_batch(1)
    assert store.delete_batch(key.pk, batch.batch_id) == "not_ended"
    store.cancel_batch(key.pk, batch.batch_id)
    other, _ = create_api_key("not-the-owner")
    assert store.delete_batch(other.pk, batch.batch_id) == "not_found"
    assert store.delete_batch(key.pk, batch.batch_id) == "deleted"
    assert not BatchItem.objects.exists() and not MessageBatch.objects.exists()


def test_list_newest_first_and_both_cursors() -> None:
    key, _ = create_api_key("lister")
    ids = [new_batch(1, key)[1].batch_id for _ in range(5)]
    newest = list(reversed(ids))

    def page(**query: Any) -> tuple[list[str], bool]:
        found = store.list_batches(key.pk, PageQuery(**query))
        return [b.batch_id for b in found.batches], found.has_more

    assert page() == (newest, False)
    assert page(limit=2) == (newest[:2], True)
    assert page(limit=2, after_id=newest[1]) == (newest[2:4], True)
    assert page(limit=2, after_id=newest[3]) == (newest[4:], False)
    assert page(limit=2, before_id=newest[4]) == (newest[2:4], True)
    assert page(limit=2, before_id=newest[2]) == (newest[:2], False)
    other, _ = create_api_key("another-lister")
    assert store.list_batches(other.pk, PageQuery()).batches == []
    with pytest.raises(AnthropicError, match="after_id"):
        store.list_batches(other.pk, PageQuery(after_id=ids[0]))


def test_archive_keeps_the_batch_and_drops_its_results() -> None:
    key, batch = new_batch(2)
    store.cancel_batch(key.pk, batch.batch_id)
    assert store.archive(timedelta(days=29)) == 0
    MessageBatch.objects.update(created_at=datetime.now(timezone.utc) - timedelta(days=30))
    assert store.archive(timedelta(days=29), dry_run=True) == 1
    assert store.archive(timedelta(days=29)) == 1
    archived = store.get_batch(key.pk, batch.batch_id)
    assert archived is not None and archived.archived_at is not None and archived.canceled == 2
    assert not BatchItem.objects.exists()
    assert store.archive(timedelta(days=29)) == 0


def test_the_postgresql_claim_locks_and_skips() -> None:
    """On PostgreSQL a claim reads with `FOR UPDATE OF <items> SKIP LOCKED`, ordered and limited,
    so that processes claiming at once take different rows and never wait on each other."""
    postgres = PostgresWrapper(
        {"ENGINE": "django.db.backends.postgresql", "NAME": "never-connected", "USER": "", "PASSWORD": "", "HOST": "", "PORT": "",
         "OPTIONS": {}, "TIME_ZONE": None, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": False, "AUTOCOMMIT": True,
         "ATOMIC_REQUESTS": False, "TEST": {}},
        alias="postgres-shape",
    )  # fmt: skip
    postgres.get_autocommit = lambda: False  # type: ignore[method-assign]  # as inside the claim's transaction

    def no_connection() -> None:
        raise AssertionError("compiling must not connect")

    postgres.connect = no_connection  # type: ignore[method-assign]
    query = store.claimable(datetime.now(timezone.utc), postgres).values_list("pk", flat=True)[:7]
    sql, _ = query.query.get_compiler(connection=postgres).as_sql()
    assert sql.endswith('ORDER BY 1 ASC LIMIT 7 FOR UPDATE OF "messages_api_batchitem" SKIP LOCKED'), sql
    assert '"messages_api_messagebatch"."processing_status" = %s' in sql and '"messages_api_batchitem"."state" = %s' in sql
    # SQLite has no row locks: Django drops FOR UPDATE there, and the claim's IMMEDIATE
    # transaction serializes claims instead.
    from django.db import connection

    if connection.vendor == "sqlite":
        assert "FOR UPDATE" not in str(store.claimable(datetime.now(timezone.utc)).query)


def test_prune_audit_archives_batches_past_their_retention(settings: Any) -> None:
    from io import StringIO

    from django.core.management import call_command

    key, batch = new_batch(1)
    store.cancel_batch(key.pk, batch.batch_id)
    settings.BATCH_RESULTS_RETENTION_S = 3600
    MessageBatch.objects.update(created_at=datetime.now(timezone.utc) - timedelta(hours=2))
    out = StringIO()
    call_command("prune_audit", "--older-than", "30d", stdout=out)
    assert "archived 1 message batches" in out.getvalue()
    assert store.get_batch(key.pk, batch.batch_id).archived_at is not None  # type: ignore[union-attr]


def test_a_paused_keys_items_are_not_claimed() -> None:
    limited, _ = new_batch(2)
    other, _ = new_batch(1)
    claimed = store.claim(ME, 10, 60, paused_keys=[limited.key_hash])
    assert [c.key_hash for c in claimed] == [other.key_hash]
    assert len(store.claim(ME, 10, 60)) == 2


def test_items_of_a_batch_past_its_expiry_are_not_claimed() -> None:
    new_batch(1)
    MessageBatch.objects.update(expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    assert store.claim(ME, 5, 60) == []


@pytest.mark.django_db(transaction=True)
def test_a_sweep_never_waits_for_rows_another_transaction_holds() -> None:
    """On PostgreSQL the sweep skips locked rows (store.py, lock order): two sweeps, or a sweep and
    a renewal, cannot deadlock. The rows it skipped are the next sweep's."""
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("row locks: PostgreSQL")
    new_batch(3)
    claimed = store.claim(ME, 3, 60)
    BatchItem.objects.filter(pk__in=[c.pk for c in claimed]).update(lease_until=datetime.now(timezone.utc) - timedelta(hours=1))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                list(BatchItem.objects.select_for_update().filter(pk=claimed[0].pk))
                held.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        swept = store.sweep(0)  # waiting for the held row would take the holder's 10 s
        assert not release.is_set() and swept.released == 2
    finally:
        release.set()
        holder.join()
    assert store.sweep(0).released == 1


def test_a_claim_takes_no_more_of_a_keys_items_than_its_concurrency_leaves() -> None:
    """A key with max_concurrency=1 gets one item claimed, not a claim's worth that its limits
    would refuse; the items of other keys behind its own are claimed in the same claim."""
    limited, _ = create_api_key("one-at-a-time")
    limited.max_concurrency = 1
    limited.save()
    new_batch(5, key=limited)
    _, other = new_batch(3)
    claimed = store.claim(ME, 16, 60)
    assert [c.key_hash == limited.key_hash for c in claimed] == [True, False, False, False]
    assert store.key_room() == {limited.pk: 0}
    assert store.claim(OTHER, 16, 60) == []  # its one slot is taken, in any process
    assert store.finish(ME, claimed[0], "succeeded", "{}", "req_1")
    again = store.claim(OTHER, 16, 60)
    assert len(again) == 1 and again[0].key_hash == limited.key_hash and again[0].custom_id == "i1"
