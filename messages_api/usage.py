"""Usage per API key and UTC hour: requests, tokens, errors by type, time queued.

Every request that ends with a key (`AuditRecord.end`) is added to this process's tally of its
key and hour (a Message Batch item's also to the hour's `batch_*` counts, the part of its requests
and tokens that batches were): a dict lookup and a few additions, no query. The tallies are added
to the database as increments, not values: one `INSERT … ON CONFLICT (api_key_id, hour) DO UPDATE SET requests =
requests + excluded.requests, …` for all of them, on SQLite and PostgreSQL alike, so any number of
gateway processes add to the same rows and the sums come out right.

A request's usage is counted in the transaction that makes its audit row terminal, so that after
any crash the usage per key and hour is the sum over the terminal audit rows:

- the process's recorder is the row writer's companion for audit rows (workers' `RowWriter.
  accompany`): `AuditRecord.end` hands the record over with its terminal row, under the writer's
  lock, and the writer adds the tallies taken with a batch in the transaction that writes the
  batch's rows. A SIGKILL loses both, or neither (before, the tallies went every 5 s on a thread
  of their own, and a kill lost up to 5 s of them while their rows were kept);
- the recovery sweep, closing a dead process's rows that were still in progress as failed, counts
  them in the same transaction (`count_abandoned`).

A request refused without a row (a sampled-out refusal: `end(persist=False)`) is tallied alone and
goes with the next batch. A batch the writer cannot write (its rows are lost) gives its tallies
back for the next one: usage is never lost to a database hiccup.

Errors by type are a JSON object per row, which neither database can add to in that statement
portably: for the rows that have errors, the same transaction then reads the row and writes it back
merged. The upsert has already taken the row's lock (PostgreSQL's row lock, SQLite's one writer),
so no other process can come between the read and the write. Rows are written in (key, hour)
order, so two processes never wait on each other's rows in opposite orders.

The hour is the one the request was received in, as the audit row's `received_at`. A request is
counted under its key's id (the audit record's `api_key_id`, set when the key was authenticated),
so renaming a key changes nothing; one known only by name (`add` with a name) is found by name
when the tallies are written. A key deleted in between (or renamed, for a name) loses that tally,
logged.

Per batch with keyed requests in it (at most one per `AUDIT_FLUSH_INTERVAL_S`), one lookup of the
keys (that the ids still exist; the ids of names), one batched upsert, and a read and a write per
row with errors. A `UsageRecorder` of its own (tests, tools) writes on `flush()`, or from a thread
every `flush_interval`.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from django.db import close_old_connections, connection, transaction
from django.db.models import Field

from disagg_project import get_writer
from messages_api.models import ApiKey, KeyUsage, MessageRequest

if TYPE_CHECKING:
    from messages_api.audit import AuditRecord

logger = logging.getLogger(__name__)

HOUR_S = 3600
# Names looked up per query (well under SQLite's and PostgreSQL's parameter limits).
NAMES_PER_QUERY = 500
COUNTED = (
    "requests", "input_tokens", "output_tokens", "cache_read_tokens", "queued_ms_total",
    "batch_requests", "batch_input_tokens", "batch_output_tokens",
)


@dataclass(slots=True)
class Tally:
    """One key's use in one hour, in this process, since the last write."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    queued_ms_total: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    # The part of the above that Message Batch items were (counted in them too).
    batch_requests: int = 0
    batch_input_tokens: int = 0
    batch_output_tokens: int = 0

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cache_read_tokens += other.cache_read_tokens
        self.queued_ms_total += other.queued_ms_total
        for error_type, count in other.errors.items():
            self.errors[error_type] = self.errors.get(error_type, 0) + count
        self.batch_requests += other.batch_requests
        self.batch_input_tokens += other.batch_input_tokens
        self.batch_output_tokens += other.batch_output_tokens


TallyKey = tuple[int | str, int]  # (API key id, or its name when the id is not known; hours since the epoch)


def hour_of(moment: datetime) -> int:
    """Hours since the epoch of an aware datetime (its UTC hour)."""
    return int(moment.timestamp()) // HOUR_S


def hour_start(hour: int) -> datetime:
    return datetime.fromtimestamp(hour * HOUR_S, timezone.utc)


class UsageRecorder:
    """Tallies per (key, hour), written by `flush()`, by a thread of its own every `flush_interval`
    (0: none), or with the audit rows when `with_rows` (see the module)."""

    def __init__(self, flush_interval: float, *, with_rows: bool = False) -> None:
        self.flush_interval = 0.0 if with_rows else flush_interval
        self._pending: dict[TallyKey, Tally] = {}
        self._lock = threading.Lock()  # the pending tallies
        self._write_lock = threading.Lock()  # one write at a time (the thread's, or a flush's)
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self.writes = 0
        self.write_errors = 0
        self.dropped_keys = 0
        self._with_rows = with_rows
        if with_rows:
            get_writer().accompany(MessageRequest, self)

    def add(
        self,
        key: int | str,
        hour: int,
        *,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cache_read_tokens: int = 0,
        queued_ms: float = 0.0,
        error_type: str = "",
        batch: bool = False,
    ) -> None:
        """Count one request of `key` (an id, or a name) received in `hour` (hours since the epoch);
        `batch`: a Message Batch item's."""
        with self._lock:
            tally = self._pending.get((key, hour))
            if tally is None:
                tally = self._pending[(key, hour)] = Tally()
                if self._thread is None and self.flush_interval > 0:  # 0: written only by flush()
                    self._start()
            tally.requests += 1
            tally.input_tokens += input_tokens
            tally.output_tokens += output_tokens
            tally.cache_read_tokens += cache_read_tokens
            tally.queued_ms_total += queued_ms
            if error_type:
                tally.errors[error_type] = tally.errors.get(error_type, 0) + 1
            if batch:
                tally.batch_requests += 1
                tally.batch_input_tokens += input_tokens
                tally.batch_output_tokens += output_tokens

    def note(self, record: AuditRecord) -> None:
        """Count an ended request that has no row (written with the next batch of rows, when the
        recorder goes with them)."""
        self.keep(record)
        if self._with_rows:
            get_writer().nudge()

    def keep(self, record: AuditRecord) -> None:
        """Count an ended request (its key, hour, tokens, error type, time queued): `add`, inlined
        (this runs on the event loop for every request). The row writer calls it with the record's
        terminal row (`Companion.keep`)."""
        key = (record.api_key_id or record.api_key_name, int(record.received_at.timestamp()) // HOUR_S)
        with self._lock:
            tally = self._pending.get(key)
            if tally is None:
                tally = self._pending[key] = Tally()
                if self._thread is None and self.flush_interval > 0:
                    self._start()
            tally.requests += 1
            # Input as billed: what was not read from a cache, written to one included.
            input_tokens = (record.input_tokens or 0) + (record.cache_creation_input_tokens or 0)
            tally.input_tokens += input_tokens
            tally.output_tokens += record.output_tokens or 0
            if record.batch_id:
                tally.batch_requests += 1
                tally.batch_input_tokens += input_tokens
                tally.batch_output_tokens += record.output_tokens or 0
            tally.cache_read_tokens += record.cache_read_input_tokens or 0
            tally.queued_ms_total += record.queued_ms or 0.0
            if record.error_type:
                tally.errors[record.error_type] = tally.errors.get(record.error_type, 0) + 1

    def pending(self) -> dict[TallyKey, Tally]:
        """A copy of the tallies not written yet (tests)."""
        with self._lock:
            return {key: Tally(t.requests, t.input_tokens, t.output_tokens, t.cache_read_tokens, t.queued_ms_total, dict(t.errors),
                               t.batch_requests, t.batch_input_tokens, t.batch_output_tokens)
                    for key, t in self._pending.items()}  # fmt: skip

    # -- the row writer's companion (disagg_project.writer.Companion) --------------------------

    def take(self) -> dict[TallyKey, Tally] | None:
        """The tallies so far, for the writer's batch."""
        with self._lock:
            batch, self._pending = self._pending, {}
        return batch or None

    def write(self, taken: dict[TallyKey, Tally]) -> None:
        """Add `taken` to the database, in the transaction of the batch's rows."""
        self._write(taken)
        self.writes += 1

    def give_back(self, taken: dict[TallyKey, Tally]) -> None:
        self.write_errors += 1
        logger.error("usage: %d hourly tallies not written with their batch; kept for the next", len(taken))
        self._merge_back(taken)

    def _merge_back(self, batch: dict[TallyKey, Tally]) -> None:
        with self._lock:
            for key, tally in batch.items():
                mine = self._pending.get(key)
                if mine is None:
                    self._pending[key] = tally
                else:
                    mine.add(tally)

    def flush(self) -> bool:
        """Write the tallies now, on the calling thread (tests, shutdown); whether it succeeded."""
        with self._write_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return True
            try:
                self._write(batch)
            except Exception:  # the database is down or refused: keep the counts for the next write
                self.write_errors += 1
                logger.exception("usage: %d hourly tallies not written; kept for the next write", len(batch))
                connection.close()
                self._merge_back(batch)
                return False
            finally:
                if connection.vendor != "sqlite":
                    close_old_connections()  # pooled: back to the pool between writes
            self.writes += 1
            return True

    def close(self) -> None:
        """Stop the thread and write what is left (at exit)."""
        self._wakeup.set()
        self.flush()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._wakeup.wait(self.flush_interval):  # set only by close(), which flushes
            self.flush()

    def _write(self, batch: dict[TallyKey, Tally]) -> None:
        ids = _key_ids({key for key, _ in batch if isinstance(key, str)})
        existing = _existing_ids({key for key, _ in batch if isinstance(key, int)})
        rows: list[tuple[int, int, Tally]] = []
        for (key, hour), tally in batch.items():
            key_id = ids.get(key) if isinstance(key, str) else (key if key in existing else None)
            if key_id is None:
                self.dropped_keys += 1
                what = f"named {key!r}" if isinstance(key, str) else f"with id {key}"
                logger.warning("usage: no API key %s any more; %d requests of it not counted", what, tally.requests)
            else:
                rows.append((key_id, hour, tally))
        rows.sort(key=lambda row: (row[0], row[1]))  # one lock order in every process
        if not rows:
            return
        sql, hour_field, errors_field = _upsert_sql()
        no_errors = errors_field.get_db_prep_save({}, connection)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.executemany(
                sql,
                [
                    (key_id, hour_field.get_db_prep_save(hour_start(hour), connection), t.requests, t.input_tokens,
                     t.output_tokens, t.cache_read_tokens, t.queued_ms_total, t.batch_requests, t.batch_input_tokens,
                     t.batch_output_tokens, no_errors)
                    for key_id, hour, t in rows
                ],
            )  # fmt: skip
            for key_id, hour, tally in rows:
                if tally.errors:
                    _merge_errors(key_id, hour_start(hour), tally.errors)


def count_abandoned(rows: list[dict[str, Any]], error_type: str) -> None:
    """Add to the usage the audit rows the recovery sweep is closing (each `MessageRequest.values()`
    with the fields of `ABANDONED_FIELDS`), failed with `error_type`; inside the transaction that
    closes them."""
    recorder = UsageRecorder(0)
    for row in rows:
        key = row["api_key_id"] or row["api_key_name"]
        if not key:
            continue
        recorder.add(
            key, hour_of(row["received_at"]),
            input_tokens=(row["input_tokens"] or 0) + (row["cache_creation_input_tokens"] or 0),
            output_tokens=row["output_tokens"] or 0, cache_read_tokens=row["cache_read_input_tokens"] or 0,
            queued_ms=row["queued_ms"] or 0.0, error_type=error_type, batch=bool(row["batch_id"]),
        )  # fmt: skip
    batch = recorder.take()
    if batch is not None:
        recorder._write(batch)


# The audit row's fields `count_abandoned` reads.
ABANDONED_FIELDS = (
    "api_key_id", "api_key_name", "received_at", "input_tokens", "cache_creation_input_tokens", "output_tokens",
    "cache_read_input_tokens", "queued_ms", "batch_id",
)  # fmt: skip


def _key_ids(names: set[str]) -> dict[str, int]:
    ordered = sorted(names)
    ids: dict[str, int] = {}
    for start in range(0, len(ordered), NAMES_PER_QUERY):
        ids.update(ApiKey.objects.filter(name__in=ordered[start : start + NAMES_PER_QUERY]).values_list("name", "id"))
    return ids


def _existing_ids(wanted: set[int]) -> set[int]:
    ordered = sorted(wanted)
    found: set[int] = set()
    for start in range(0, len(ordered), NAMES_PER_QUERY):
        found.update(ApiKey.objects.filter(id__in=ordered[start : start + NAMES_PER_QUERY]).values_list("id", flat=True))
    return found


def _merge_errors(key_id: int, hour: datetime, errors: dict[str, int]) -> None:
    """Add `errors` to the row's; the caller's upsert holds the row's lock."""
    row = KeyUsage.objects.filter(api_key_id=key_id, hour=hour)
    stored: dict[str, int] = dict(row.values_list("errors", flat=True).get() or {})
    for error_type, count in errors.items():
        stored[error_type] = int(stored.get(error_type, 0)) + count
    row.update(errors=stored)


AnyField = Field[Any, Any]
_SQL: dict[str, tuple[str, AnyField, AnyField]] = {}


def _upsert_sql() -> tuple[str, AnyField, AnyField]:
    """The increment statement for this connection's database, and the fields whose values need
    Django's preparation (the hour, the errors)."""
    cached = _SQL.get(connection.vendor)
    if cached is not None:
        return cached
    quote = connection.ops.quote_name
    table = quote(KeyUsage._meta.db_table)
    key_column, hour_column, errors_column = (quote(_field(name).column) for name in ("api_key", "hour", "errors"))
    counted = [quote(_field(name).column) for name in COUNTED]
    columns = [key_column, hour_column, *counted, errors_column]
    updates = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in counted)
    sql = (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))}) "
        f"ON CONFLICT ({key_column}, {hour_column}) DO UPDATE SET {updates}"
    )
    _SQL[connection.vendor] = cached = (sql, _field("hour"), _field("errors"))
    return cached


def _field(name: str) -> AnyField:
    field = KeyUsage._meta.get_field(name)
    assert isinstance(field, Field)
    return field


_recorder: UsageRecorder | None = None
_recorder_lock = threading.Lock()


def get_recorder() -> UsageRecorder:
    global _recorder
    if _recorder is None:
        with _recorder_lock:
            if _recorder is None:
                _recorder = UsageRecorder(0, with_rows=True)
                atexit.register(_recorder.close)
    return _recorder


def note(record: AuditRecord) -> None:
    """Count an ended request of an API key that leaves no audit row (`AuditRecord.end`); one
    with a row is handed to the row writer with it, for the process's recorder, which the app
    attaches to the writer when it starts (apps.py)."""
    (_recorder or get_recorder()).note(record)

