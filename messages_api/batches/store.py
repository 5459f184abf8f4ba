"""The batches' rows: every read and write the API and the runner make, as short synchronous ORM
functions run on a `DatabaseThread` (never a transaction held while an item runs).

Claims. A process claims queued items of batches in progress by setting `claimed_by` (its
instance), `lease_until`, and adding one to `attempts`, in one short transaction:
- PostgreSQL: `SELECT … FOR UPDATE OF item SKIP LOCKED LIMIT n`, then the `UPDATE` of those rows:
  processes claiming at once each take other rows, none waits on another's.
- SQLite: the same statements in a transaction that takes the write lock at its start
  (`transaction_mode = IMMEDIATE`, disagg_project/settings.py), so claims are serialized; Django
  drops `FOR UPDATE` on SQLite.

Fencing. Only the claim (instance and attempt both matching, the item still `running`) can write
an item's result, give it back to the queue, or renew its lease; a process that lost its lease
(expired, recovered after it was thought dead, expired with its batch) changes nothing.

Lock order. Every statement that writes several items locks them first, in primary-key order,
in a short transaction of its own (`_update_items`): on PostgreSQL two such writers can then never
wait for each other in a cycle. The sweep's writes skip rows another transaction holds (the
writer holding them is finishing, renewing or sweeping them; the next sweep takes what is left),
so a sweep never waits at all. Single-row writes (a result, a requeue) and the batch row's own
updates hold no other lock while they wait.

Ending. A batch ends when none of its items is queued or running: its counts are written then,
once (a conditional update on its status).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Count, F, QuerySet

from disagg_project import DatabaseThread
from messages_api.batches.schema import BatchView, ItemSpec, PageQuery, new_batch_id
from messages_api.errors import InvalidRequest
from messages_api.models import ApiKey, BatchItem, BatchStatus, ItemState, MessageBatch, ResultType

__all__ = [
    "API_THREAD",
    "archive",
    "cancel_batch",
    "CANCELED_RESULT",
    "claim",
    "claimable",
    "Claimed",
    "create_batch",
    "delete_batch",
    "EXPIRED_RESULT",
    "finish",
    "get_batch",
    "key_room",
    "list_batches",
    "Page",
    "release_instances",
    "renew",
    "requeue",
    "results_batch",
    "results_chunk",
    "RUNNER_THREAD",
    "sweep",
    "Swept",
    "unfinished_counts",
]

# The API's reads and writes, and the runner's: one thread each, so a claim never queues behind
# a large create.
API_THREAD = DatabaseThread("batches-api")
RUNNER_THREAD = DatabaseThread("batches-runner")

CANCELED_RESULT = '{"type":"canceled"}'
EXPIRED_RESULT = '{"type":"expired"}'
_UNFINISHED = (ItemState.QUEUED, ItemState.RUNNING)
# Items inserted per statement when a batch is created.
INSERT_ROWS = 1000
# Items locked and written per transaction by a multi-row write (`_update_items`).
LOCK_ROWS = 1000

_VIEW_FIELDS = (
    "batch_id", "processing_status", "created_at", "expires_at", "ended_at", "cancel_initiated_at", "archived_at",
    "total", "succeeded", "errored", "canceled", "expired",
)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _view(batch: MessageBatch) -> BatchView:
    return BatchView(**{name: getattr(batch, name) for name in _VIEW_FIELDS})


def _update_items(items: QuerySet[BatchItem], *, skip_locked: bool = False, **values: Any) -> int:
    """Set `values` on the items, LOCK_ROWS at a time, each chunk's rows locked in primary-key
    order before they are written (the lock order of every multi-row write, see the module's
    docstring); with `skip_locked`, rows another transaction holds are left as they are. The
    values must take a row out of `items` (the loop ends when nothing matches). How many were
    written."""
    locking = connection.features.has_select_for_update_skip_locked
    written = 0
    while True:
        with transaction.atomic():
            chunk = items.order_by("pk")
            if locking:
                chunk = chunk.select_for_update(skip_locked=skip_locked, of=("self",))
            pks = list(chunk.values_list("pk", flat=True)[:LOCK_ROWS])
            if pks:
                written += BatchItem.objects.filter(pk__in=pks).update(**values)
        if len(pks) < LOCK_ROWS:
            return written


# --- the API ---------------------------------------------------------------------------------------


def create_batch(key_id: int, key_name: str, items: list[ItemSpec], traceparent: str = "") -> BatchView:
    """A new batch of `items`; `traceparent`, the creating request's span, which its items' traces link to."""
    now = _now()
    with transaction.atomic():
        batch = MessageBatch.objects.create(
            batch_id=new_batch_id(), api_key_id=key_id, api_key_name=key_name, created_at=now,
            expires_at=now + timedelta(seconds=settings.BATCH_EXPIRY_S), total=len(items), traceparent=traceparent,
        )
        for start in range(0, len(items), INSERT_ROWS):
            BatchItem.objects.bulk_create(
                [
                    BatchItem(batch=batch, position=start + i, custom_id=item.custom_id, params=item.params.decode(), not_before=now)
                    for i, item in enumerate(items[start : start + INSERT_ROWS])
                ]
            )
    return _view(batch)


def _owned(key_id: int, batch_id: str) -> MessageBatch | None:
    return MessageBatch.objects.filter(api_key_id=key_id, batch_id=batch_id).first()


def get_batch(key_id: int, batch_id: str) -> BatchView | None:
    """The key's batch, or None (another key's batch is as unknown as a missing one)."""
    batch = _owned(key_id, batch_id)
    return _view(batch) if batch is not None else None


@dataclass(frozen=True, slots=True)
class Page:
    batches: list[BatchView]
    has_more: bool


def list_batches(key_id: int, query: PageQuery) -> Page:
    """The key's batches, newest first (by creation: the primary key), from a cursor."""
    mine = MessageBatch.objects.filter(api_key_id=key_id)
    cursor_id = query.after_id or query.before_id
    if cursor_id is not None:
        cursor = mine.filter(batch_id=cursor_id).values_list("pk", flat=True).first()
        if cursor is None:
            raise InvalidRequest(f"{'after_id' if query.after_id else 'before_id'}: no message batch {cursor_id!r}")
        if query.before_id:
            # The page right before the cursor in the list's order: the newer ones nearest it.
            newer = list(mine.filter(pk__gt=cursor).order_by("pk")[: query.limit + 1])
            has_more = len(newer) > query.limit
            return Page([_view(b) for b in reversed(newer[: query.limit])], has_more)
        mine = mine.filter(pk__lt=cursor)
    rows = list(mine.order_by("-pk")[: query.limit + 1])
    return Page([_view(b) for b in rows[: query.limit]], len(rows) > query.limit)


def cancel_batch(key_id: int, batch_id: str) -> BatchView | None:
    """Start the cancellation of the key's batch (nothing for one already canceling or ended):
    its queued items are canceled now, the running ones finish, and it ends when they have."""
    batch = _owned(key_id, batch_id)
    if batch is None:
        return None
    if batch.processing_status == BatchStatus.IN_PROGRESS:
        now = _now()
        with transaction.atomic():
            MessageBatch.objects.filter(pk=batch.pk, processing_status=BatchStatus.IN_PROGRESS).update(
                processing_status=BatchStatus.CANCELING, cancel_initiated_at=now
            )
            _cancel_queued([batch.pk], now)
        _end_if_done([batch.pk])
        batch.refresh_from_db()
    return _view(batch)


def _cancel_queued(batch_pks: list[int], now: datetime, *, skip_locked: bool = False) -> int:
    return _update_items(
        BatchItem.objects.filter(batch_id__in=batch_pks, state=ItemState.QUEUED), skip_locked=skip_locked,
        state=ItemState.DONE, result_type=ResultType.CANCELED, result=CANCELED_RESULT, finished_at=now,
    )


def delete_batch(key_id: int, batch_id: str) -> str:
    """`deleted`, `not_found`, or `not_ended` (a batch is deleted only once it has ended)."""
    batch = _owned(key_id, batch_id)
    if batch is None:
        return "not_found"
    if batch.processing_status != BatchStatus.ENDED:
        return "not_ended"
    with transaction.atomic():
        BatchItem.objects.filter(batch_id=batch.pk).delete()
        MessageBatch.objects.filter(pk=batch.pk).delete()
    return "deleted"


def results_batch(key_id: int, batch_id: str) -> tuple[int, BatchView] | None:
    """The key's batch's primary key (results are read by it) and its view."""
    batch = _owned(key_id, batch_id)
    return (batch.pk, _view(batch)) if batch is not None else None


def results_chunk(batch_pk: int, after: int, size: int) -> list[tuple[int, str, str]]:
    """Up to `size` results of a batch's items after the item `after` (its primary key): (item pk,
    custom_id, result JSON), in item order. Keyset paging: each chunk is one indexed range read."""
    rows = (
        BatchItem.objects.filter(batch_id=batch_pk, pk__gt=after, state=ItemState.DONE)
        .order_by("pk")
        .values_list("pk", "custom_id", "result")[:size]
    )
    return [(pk, custom_id, result or "") for pk, custom_id, result in rows]


# --- the runner ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claimed:
    """An item this process holds: `attempt` is its claim (the fence of every later write)."""

    pk: int
    batch_pk: int
    batch_id: str
    custom_id: str
    params: bytes
    attempt: int
    key_hash: str
    batch_traceparent: str = ""  # the batch's creation span, which the item's trace links to


def claimable(now: datetime, database: BaseDatabaseWrapper = connection) -> Any:
    """The queued items a claim may take (of batches in progress and not yet past their expiry),
    oldest batch first: on a database that can (PostgreSQL)
    locked as they are read, skipping rows another process's claim holds."""
    items = BatchItem.objects.filter(
        state=ItemState.QUEUED, not_before__lte=now, batch__processing_status=BatchStatus.IN_PROGRESS, batch__expires_at__gt=now
    ).order_by("pk")
    if database.features.has_select_for_update_skip_locked:
        items = items.select_for_update(skip_locked=True, of=("self",))
    return items


def key_room() -> dict[int, int]:
    """Keys with a concurrency limit and a batch in progress: how many more of their items may run
    (the limit less their items running in every process). A claim takes no more: items beyond it
    would only be refused (429) by the key's limits once claimed. Counted in the database, so it
    holds whether the limits are shared (Redis) or each process's own (then it is the stricter)."""
    limits = dict(
        ApiKey.objects.filter(max_concurrency__isnull=False, batches__processing_status=BatchStatus.IN_PROGRESS)
        .distinct().values_list("pk", "max_concurrency")
    )
    if not limits:
        return {}
    running = dict(
        BatchItem.objects.filter(state=ItemState.RUNNING, batch__api_key_id__in=list(limits)).order_by()
        .values_list("batch__api_key_id").annotate(n=Count("pk")).values_list("batch__api_key_id", "n")
    )
    return {key: max(0, limit - running.get(key, 0)) for key, limit in limits.items()}


def claim(instance: str, size: int, lease_s: float, paused_keys: Collection[str] = ()) -> list[Claimed]:
    """Claim up to `size` queued items for `instance`, leased for `lease_s` seconds; none of the
    batches of the keys (hashes) in `paused_keys`, and no more of a key's than its concurrency
    leaves room for (`key_room`)."""
    now = _now()
    with transaction.atomic():
        items = claimable(now)
        if paused_keys:
            items = items.exclude(batch__api_key__key_hash__in=list(paused_keys))
        pks = _within_key_room(items, size)
        if not pks:
            return []
        BatchItem.objects.filter(pk__in=pks, state=ItemState.QUEUED).update(
            state=ItemState.RUNNING, claimed_by=instance, lease_until=now + timedelta(seconds=lease_s),
            attempts=F("attempts") + 1,
        )
        rows = BatchItem.objects.filter(pk__in=pks, claimed_by=instance, state=ItemState.RUNNING).order_by("pk").values_list(
            "pk", "batch_id", "batch__batch_id", "custom_id", "params", "attempts", "batch__api_key__key_hash", "batch__traceparent"
        )
        return [Claimed(pk, batch_pk, batch_id, custom_id, params.encode(), attempts, key_hash, traceparent)
                for pk, batch_pk, batch_id, custom_id, params, attempts, key_hash, traceparent in rows]  # fmt: skip


def _within_key_room(items: Any, size: int) -> list[int]:
    """Up to `size` of `items` (locked as read, where the database can), at most each key's room.
    A key whose room fills is left out of the next read, so a full key's items ahead in the queue
    do not take the claim's place (a few reads at most: one more per key that fills)."""
    room = key_room()
    taken: list[int] = []
    while len(taken) < size:
        full = [key for key, left in room.items() if left <= 0]
        rows = list(items.exclude(batch__api_key_id__in=full).exclude(pk__in=taken).values_list("pk", "batch__api_key_id")[: size - len(taken)])
        if not rows:
            break
        filled = False
        for pk, key in rows:
            left = room.get(key)
            if left is None:
                taken.append(pk)
            elif left > 0:
                taken.append(pk)
                room[key] = left - 1
            else:
                filled = True
        if not filled:
            break
    return taken


def _held(instance: str, pk: int, attempt: int) -> Any:
    return BatchItem.objects.filter(pk=pk, claimed_by=instance, attempts=attempt, state=ItemState.RUNNING)


def renew(instance: str, held: dict[int, int], lease_s: float) -> set[int]:
    """Extend the leases of the items `instance` holds (pk → attempt); the pks still held."""
    if not held:
        return set()
    with transaction.atomic():
        mine = BatchItem.objects.filter(pk__in=list(held), claimed_by=instance, state=ItemState.RUNNING).order_by("pk")
        if connection.features.has_select_for_update_skip_locked:
            mine = mine.select_for_update(of=("self",))  # in primary-key order: the lock order
        kept = {pk for pk, attempts in mine.values_list("pk", "attempts") if held.get(pk) == attempts}
        if kept:
            BatchItem.objects.filter(pk__in=kept).update(lease_until=_now() + timedelta(seconds=lease_s))
    return kept


def finish(instance: str, item: Claimed, result_type: str, result: str, request_id: str) -> bool:
    """Write the item's result, if the claim still holds it; whether it did. The batch ends here
    when this was its last unfinished item."""
    now = _now()
    written = _held(instance, item.pk, item.attempt).update(
        state=ItemState.DONE, result_type=result_type, result=result, finished_at=now, claimed_by="",
        lease_until=None, request_id=request_id,
    )
    if written:
        _end_if_done([item.batch_pk])
    return bool(written)


def requeue(instance: str, item: Claimed, not_before: datetime, request_id: str) -> bool:
    """Give the item back to the queue, not to be claimed before `not_before` (a retry's backoff)."""
    return bool(
        _held(instance, item.pk, item.attempt).update(
            state=ItemState.QUEUED, claimed_by="", lease_until=None, not_before=not_before, request_id=request_id
        )
    )


def release_instances(instances: list[str]) -> int:
    """Items held by dead processes go back to the queue (`workers.process_abandoned`)."""
    return _update_items(
        BatchItem.objects.filter(claimed_by__in=instances, state=ItemState.RUNNING),
        state=ItemState.QUEUED, claimed_by="", lease_until=None, not_before=_now(),
    )


@dataclass(frozen=True, slots=True)
class Swept:
    expired: int
    released: int
    ended: list[str]
    queued: int
    running: int


def sweep(lease_grace_s: float) -> Swept:
    """What no single process's runner does on its own, idempotent so that every process may:
    items of batches past their expiry become `expired`; leases expired `lease_grace_s` ago go
    back to the queue; queued items of canceling batches become `canceled`; batches with nothing
    left unfinished end. It skips the items another transaction holds, and so never waits."""
    now = _now()
    live = MessageBatch.objects.exclude(processing_status=BatchStatus.ENDED)
    due = list(live.filter(expires_at__lte=now).values_list("pk", flat=True))
    expired = 0
    if due:
        expired = _update_items(
            BatchItem.objects.filter(batch_id__in=due, state__in=_UNFINISHED), skip_locked=True,
            state=ItemState.DONE, result_type=ResultType.EXPIRED, result=EXPIRED_RESULT, finished_at=now,
            claimed_by="", lease_until=None,
        )
    released = _update_items(
        BatchItem.objects.filter(state=ItemState.RUNNING, lease_until__lt=now - timedelta(seconds=lease_grace_s)),
        skip_locked=True, state=ItemState.QUEUED, claimed_by="", lease_until=None, not_before=now,
    )
    canceling = list(live.filter(processing_status=BatchStatus.CANCELING).values_list("pk", flat=True))
    if canceling:
        _cancel_queued(canceling, now, skip_locked=True)
    ended = _end_if_done(list(live.values_list("pk", flat=True)))
    depth = dict(
        BatchItem.objects.filter(state__in=_UNFINISHED).order_by().values_list("state").annotate(n=Count("pk")).values_list("state", "n")
    )
    return Swept(expired, released, ended, depth.get(ItemState.QUEUED, 0), depth.get(ItemState.RUNNING, 0))


def _end_if_done(batch_pks: list[int]) -> list[str]:
    """End those of the batches with no item queued or running; their public ids."""
    ended: list[str] = []
    for pk in batch_pks:
        if BatchItem.objects.filter(batch_id=pk, state__in=_UNFINISHED).exists():
            continue
        counts = dict(
            BatchItem.objects.filter(batch_id=pk).order_by().values_list("result_type").annotate(n=Count("pk")).values_list("result_type", "n")
        )
        if MessageBatch.objects.filter(pk=pk).exclude(processing_status=BatchStatus.ENDED).update(
            processing_status=BatchStatus.ENDED, ended_at=_now(),
            succeeded=counts.get(ResultType.SUCCEEDED, 0), errored=counts.get(ResultType.ERRORED, 0),
            canceled=counts.get(ResultType.CANCELED, 0), expired=counts.get(ResultType.EXPIRED, 0),
        ):
            ended.append(MessageBatch.objects.filter(pk=pk).values_list("batch_id", flat=True).get())
    return ended


def archive(older_than: timedelta, *, dry_run: bool = False) -> int:
    """Archive ended batches created before now - `older_than`: `archived_at` set, their items
    (params and results) deleted. The number of batches archived."""
    cutoff = _now() - older_than
    due = MessageBatch.objects.filter(processing_status=BatchStatus.ENDED, archived_at__isnull=True, created_at__lt=cutoff)
    if dry_run:
        return due.count()
    archived = 0
    for pk in list(due.values_list("pk", flat=True)):
        with transaction.atomic():
            BatchItem.objects.filter(batch_id=pk).delete()
            archived += MessageBatch.objects.filter(pk=pk, archived_at__isnull=True).update(archived_at=_now())
    return archived


def unfinished_counts(batch_pks: list[int]) -> dict[int, dict[str, int]]:
    """Items of each batch by state or result (`queued`, `running`, and each result type), for
    the admin's progress."""
    counts: dict[int, dict[str, int]] = {pk: {} for pk in batch_pks}
    rows = (
        BatchItem.objects.filter(batch_id__in=batch_pks).order_by().values_list("batch_id", "state", "result_type")
        .annotate(n=Count("pk")).values_list("batch_id", "state", "result_type", "n")
    )
    for batch_pk, state, result_type, n in rows:
        label = result_type if state == ItemState.DONE else state
        counts[batch_pk][label] = counts[batch_pk].get(label, 0) + n
    return counts

