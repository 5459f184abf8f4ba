"""A background writer that keeps database rows off the request's path.

Requests hand it the current state of a row (`upsert`); one thread per process writes batches, one
transaction per table, each row once per batch with its latest state (`INSERT … ON CONFLICT DO
UPDATE`). A request therefore never waits on the database, and the ORM's single shared async thread
is never busy with audit writes.

A batch is what came within `AUDIT_FLUSH_INTERVAL_S` of its first row. The window is the writer's
main cost lever: a transaction's work is mostly the pages it rewrites (on SQLite 13 WAL frames for
one audit row, whose table has nine indexes), and rows written together share most of them.
Measured on the paced relay benchmark, 250 ms instead of 50 ms took the gateway's threads other
than the event loop's (the writer, and the time-driven work) from ~7 to ~4 µs per relayed event at
2,500 events/s. `flush()` (tests, shutdown) does not wait for the window.

A big batch is written in slices of `SLICE_ROWS` rows, with a pause between slices (still in
the one transaction): preparing and binding rows holds the GIL, and a batch of a hundred rows
in one go kept the event loop waiting long enough to show in its latency (`bench/relay.py --part
latency`, one request at a time, 2,000 samples: the added p99 was 2.8 ms with the 50 ms window,
4.1 ms with 250 ms in one go, 2.6 / 3.0 ms sliced). Cutting the batch itself short (writing at 32
rows) did as well for latency but cost throughput: more, smaller transactions (non-streamed
requests/s 529 against 608 sliced).

The cost is a window of at most `AUDIT_FLUSH_INTERVAL_S` (plus the write itself) in which a row is
only in memory: a process killed in that window loses it. Crash recovery closes what did reach the
database; a reservation that never did was never visible to another process either.

What must be exactly as durable as a row goes with it: a model's `Companion` (`accompany`) keeps
what was handed over with its rows (`upsert(..., along=item)`), and the writer writes it in the
same transaction as the batch those rows are in, after them. Handing over happens under the
writer's lock, the same as queueing the row, so a crash loses both or neither (the audit's usage
counts, messages_api/usage.py).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any, Protocol

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Field, Model

logger = logging.getLogger(__name__)

RowKey = tuple[type[Model], str]

# A batch is written this many rows at a time, with a pause between (see above).
SLICE_ROWS = 32
SLICE_PAUSE_S = 0.0005

#: Django's field classes whose `get_db_prep_save` hands a value of these exact types back as it
#: is, on SQLite and PostgreSQL alike (None too). The writer passes such values through and
#: prepares only the rest (datetimes above all): Django's preparation of every value was half the
#: CPU of an audit row's write (31 of ~60 µs, 22 columns). Exact classes, not subclasses: a
#: subclass may prepare its values its own way.
PASSED_THROUGH: dict[type[Field[Any, Any]], tuple[type, ...]] = {
    models.CharField: (str,),
    models.TextField: (str,),
    models.BooleanField: (bool,),
    models.IntegerField: (int,),
    models.SmallIntegerField: (int,),
    models.BigIntegerField: (int,),
    models.PositiveIntegerField: (int,),
    models.PositiveSmallIntegerField: (int,),
    models.PositiveBigIntegerField: (int,),
    models.FloatField: (float,),
}


class Companion(Protocol):
    """What is written with a model's rows, in their transaction (`RowWriter.accompany`)."""

    def keep(self, item: Any) -> None:
        """Hold `item`, handed over with a row (`upsert(..., along=item)`) or alone (after `nudge`).
        Called under the writer's lock: quick, no I/O, never calling the writer back."""

    def take(self) -> Any:
        """What was kept since the last take, now the writer's (under its lock); None for nothing."""

    def write(self, taken: Any) -> None:
        """Write what `take` returned, inside the transaction of the model's rows (after them).
        Raising fails the transaction: rows and all are retried."""

    def give_back(self, taken: Any) -> None:
        """The batch failed for good (its rows are lost): keep `taken` for the next one."""


class RowWriter:
    def __init__(self, flush_interval: float) -> None:
        self.flush_interval = flush_interval
        self._pending: dict[RowKey, dict[str, Any]] = {}
        self._unique_field: dict[type[Model], str] = {}
        self._sql: dict[tuple[type[Model], tuple[str, ...]], tuple[str, list[Field[Any, Any]]]] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._hurry = threading.Event()  # a flush waits: write without waiting for the window
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._thread: threading.Thread | None = None
        self._companions: dict[type[Model], Companion] = {}
        self._kept = False  # a companion holds something for the next batch
        self._stopping = False
        self.rows_written = 0
        self.batches_written = 0
        self.write_errors = 0

    def upsert(self, model: type[Model], unique_field: str, values: dict[str, Any], *, along: Any = None) -> None:
        """Queue the current state of one row, identified by `values[unique_field]`.

        `values` is the whole row (every column but the primary key): it is inserted, or written
        over the row with the same `unique_field`. `along`, if not None, goes to the model's
        companion (`accompany`) and is written in the transaction that writes this state.
        """
        key = (model, str(values[unique_field]))
        with self._lock:
            self._unique_field[model] = unique_field
            pending = self._pending
            # Only the first row of a batch wakes the writer (an Event's set is a condition
            # variable's notify: ~10 calls, five rows a request); later rows join the batch the
            # woken writer takes after its window.
            wake = not pending
            previous = pending.get(key)
            if previous is None:
                pending[key] = dict(values)
            else:
                previous.update(values)
            if along is not None:
                self._companions[model].keep(along)
                self._kept = True
            self._ensure_thread()
        if wake:
            self._wakeup.set()

    def accompany(self, model: type[Model], companion: Companion) -> None:
        """Write what `companion` keeps in the transactions of `model`'s rows (one per model)."""
        with self._lock:
            self._companions[model] = companion

    def nudge(self) -> None:
        """A companion kept something without a row: write it with the next batch, which starts
        now if none is pending. Not to be called from a companion's `keep`."""
        with self._lock:
            wake = not self._pending and not self._kept
            self._kept = True
            self._ensure_thread()
        if wake:
            self._wakeup.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Block until everything queued so far is written (tests, shutdown). Not for async code."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or self._kept or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._hurry.set()
                self._wakeup.set()
                self._idle.wait(remaining)
        return True

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="row-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._write_until_stopped()
        finally:
            # The connection the thread kept between batches goes with it: back to the pool on
            # PostgreSQL, where a stopped writer's would otherwise stay checked out for good.
            connection.close()

    def _write_until_stopped(self) -> None:
        while True:
            self._wakeup.wait(timeout=1.0)
            self._wakeup.clear()
            # Let what comes within the window join this batch, unless a flush waits for it.
            self._hurry.wait(self.flush_interval)
            self._hurry.clear()
            with self._lock:
                batch, self._pending = self._pending, {}
                # Taken with the rows, under the same lock: what went along with a row is in its batch.
                taken = {}
                if self._kept:
                    self._kept = False
                    for model, companion in self._companions.items():
                        items = companion.take()
                        if items is not None:
                            taken[model] = items
                self._in_flight = len(batch) + len(taken)
            if batch or taken:
                self._write(batch, taken)
            with self._lock:
                self._in_flight = 0
                self._idle.notify_all()
                if self._stopping and not self._pending and not self._kept:
                    return

    def _write(self, batch: dict[RowKey, dict[str, Any]], taken: dict[type[Model], Any]) -> None:
        by_model: dict[type[Model], list[dict[str, Any]]] = {model: [] for model in taken}
        for (model, _), values in batch.items():
            by_model.setdefault(model, []).append(values)
        # One transaction per table (and what accompanies its rows): the writer never holds one
        # table's lock while it waits for another's, so it cannot deadlock with anything that
        # locks tables in another order. A companion's rows are its own concern: the audit's
        # usage rows are taken in one order by every writer (messages_api/usage.py).
        for model, rows in by_model.items():
            self._write_model(model, rows, taken.get(model))

    def _write_model(self, model: type[Model], rows: list[dict[str, Any]], taken: Any = None) -> None:
        for attempt in range(3):
            try:
                # The thread keeps its connection between batches (opening one per batch cost
                # more than the writes); it is dropped and reopened only after an error.
                with transaction.atomic():
                    if rows:
                        self._upsert_rows(model, rows)
                    if taken is not None:
                        self._companions[model].write(taken)
                self.rows_written += len(rows)
                self.batches_written += 1
                return
            except Exception:  # the writer must survive a database hiccup
                self.write_errors += 1
                logger.exception("row writer: %d %s rows failed (attempt %d)", len(rows), model.__name__, attempt + 1)
                connection.close()
                time.sleep(0.2 * (attempt + 1))
        if taken is not None:
            self._companions[model].give_back(taken)

    def _upsert_rows(self, model: type[Model], rows: list[dict[str, Any]]) -> None:
        """One `INSERT … ON CONFLICT (unique) DO UPDATE` executed for all rows of a shape.

        Plain SQL rather than `bulk_create(update_conflicts=True)`: the ORM's per-row compilation
        was most of the writer's CPU, and this thread shares the GIL with the event loop. SQLite
        and PostgreSQL both speak this form; values are prepared as each field's own
        `get_db_prep_save` would (`prepare_row`).
        """
        unique_field = self._unique_field[model]
        by_shape: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for row in rows:
            by_shape.setdefault(tuple(row), []).append(row)
        with connection.cursor() as cursor:
            for shape, same in by_shape.items():
                sql, fields = self._upsert_sql(model, shape, unique_field)
                for start in range(0, len(same), SLICE_ROWS):
                    if start:
                        time.sleep(SLICE_PAUSE_S)  # the event loop's turn at the GIL
                    rows_slice = same[start : start + SLICE_ROWS]
                    cursor.executemany(sql, [prepare_row(row, shape, fields) for row in rows_slice])

    def _upsert_sql(self, model: type[Model], shape: tuple[str, ...], unique_field: str) -> tuple[str, list[Field[Any, Any]]]:
        key = (model, shape)
        if key not in self._sql:
            self._sql[key] = self._build_upsert_sql(model, shape, unique_field)
        return self._sql[key]

    @staticmethod
    def _build_upsert_sql(model: type[Model], shape: tuple[str, ...], unique_field: str) -> tuple[str, list[Field[Any, Any]]]:
        fields = [_column_field(model, name) for name in shape]
        quote = connection.ops.quote_name
        columns = [quote(field.column) for field in fields]
        unique = quote(_column_field(model, unique_field).column)
        updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c != unique)
        sql = (
            f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))}) "
            f"ON CONFLICT ({unique}) DO UPDATE SET {updates}"
        )
        return sql, fields

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread, which gives its connection back (exit,
        tests). Not for async code."""
        with self._lock:
            self._stopping = True
        self.flush(timeout)
        thread = self._thread
        if thread is not None:
            self._hurry.set()
            self._wakeup.set()
            thread.join(timeout)


def prepare_row(row: dict[str, Any], shape: tuple[str, ...], fields: list[Field[Any, Any]]) -> list[Any]:
    """The row's values as the database driver takes them: what Django's `get_db_prep_save`
    returns, computed only where it is not the value itself (`PASSED_THROUGH`)."""
    prepared = []
    for name, field in zip(shape, fields, strict=True):
        value = row[name]
        if value is not None and type(value) not in PASSED_THROUGH.get(type(field), ()):
            value = field.get_db_prep_save(value, connection)
        prepared.append(value)
    return prepared


def _column_field(model: type[Model], name: str) -> Field[Any, Any]:
    """The field `name` of `model`, one the writer stores in a column of the model's table."""
    field = model._meta.get_field(name)
    if not isinstance(field, Field):  # a reverse relation or a generic foreign key: no column
        raise TypeError(f"{model.__name__}.{name} is not a column")
    return field


_writer: RowWriter | None = None
_writer_lock = threading.Lock()


def get_writer() -> RowWriter:
    global _writer
    if _writer is None:
        with _writer_lock:
            if _writer is None:
                _writer = RowWriter(settings.AUDIT_FLUSH_INTERVAL_S)
                atexit.register(_writer.close)
    return _writer

