"""The row writer's value preparation: what it passes through untouched is exactly what Django's
own `get_db_prep_save` would have returned, on whichever database the suite runs."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.db import connection, models

from disagg_project import GATEWAY_INSTANCE
from disagg_project.writer import PASSED_THROUGH, SLICE_ROWS, RowWriter, _column_field, prepare_row
from messages_api.models import MessageRequest
from workers.models import Reservation

NOW = datetime(2026, 12, 4, 15, 0, 0, 123456, tzinfo=timezone.utc)


def sample_values(field: models.Field[Any, Any]) -> list[Any]:
    """Values of the type the gateway writes to `field`, None included where it is allowed."""
    if isinstance(field, models.DateTimeField):
        values: list[Any] = [NOW, NOW + timedelta(hours=5)]
    elif isinstance(field, models.BooleanField):
        values = [True, False]
    elif isinstance(field, models.FloatField):
        values = [0.0, 12.345, 1e9]
    elif isinstance(field, (models.IntegerField, models.ForeignKey)):
        values = [0, 7, 2**31 - 1]
    else:
        values = ["", "req_abc", "é ünïcode ✓", "x" * 300]
    return values + ([None] if field.null else [])


@pytest.mark.parametrize("model", [MessageRequest, Reservation])
def test_prepared_values_are_djangos_own(db: Any, model: type[models.Model]) -> None:
    names = [f.attname for f in model._meta.concrete_fields if not f.primary_key]
    fields = [_column_field(model, name) for name in names]
    shape = tuple(names)
    for column, field in enumerate(fields):
        for value in sample_values(field):
            row = {name: value if i == column else None for i, name in enumerate(names)}
            expected = [f.get_db_prep_save(row[name], connection) for name, f in zip(names, fields, strict=True)]
            assert prepare_row(row, shape, fields) == expected, (field.name, value)


def test_a_value_of_another_type_or_a_field_subclass_is_prepared_by_django(db: Any) -> None:
    class Shouting(models.CharField):  # type: ignore[type-arg]
        def get_prep_value(self, value: Any) -> Any:
            return str(value).upper()

    shouting = Shouting(max_length=10)
    integer: models.IntegerField[int, int] = models.IntegerField()
    assert type(shouting) not in PASSED_THROUGH
    assert prepare_row({"a": "quiet", "b": "12"}, ("a", "b"), [shouting, integer]) == ["QUIET", 12]


def reservation_row(reservation_id: str, outcome: str = "") -> dict[str, Any]:
    """A reservation's columns, as the gateway hands them to the writer. Held by this (live)
    process: an open row of an unknown instance, reserved long ago, is what a gateway left
    running by an earlier test sweeps as abandoned (CI's PostgreSQL run: rows read back
    `abandoned` between the flush and the read)."""
    return {
        "reservation_id": reservation_id, "request_id": f"req_{reservation_id}", "endpoint_id": 1,
        "endpoint_url": "http://w", "pool_name": "p", "stage": "generation", "gateway_instance": GATEWAY_INSTANCE,
        "reserved_at": NOW, "released_at": None, "outcome": outcome,
    }  # fmt: skip


#: A complete audit row.
AUDIT_ROW: dict[str, Any] = {
    "request_id": "req_prepared", "received_at": NOW, "route": "POST /v1/messages", "model": "m",
    "stream": True, "status": "completed", "stage": "done", "http_status": 200, "error_type": "",
    "error_message": "", "pool_name": "p", "context_endpoint": "", "generation_endpoint": "http://g",
    "headers_sent_ms": 1.5, "context_done_ms": None, "first_token_ms": 2.25, "finished_ms": 9.0,
    "pings_sent": 3, "input_tokens": 11, "output_tokens": 22, "api_key_name": "k", "gateway_instance": "gw",
}  # fmt: skip


def test_rows_written_through_the_writer_read_back_equal(transactional_db: Any) -> None:
    writer = RowWriter(0.0)
    values = AUDIT_ROW
    writer.upsert(MessageRequest, "request_id", values)
    assert writer.flush()
    row = MessageRequest.objects.get(request_id="req_prepared")
    for name, value in values.items():
        assert getattr(row, name) == value, name
    writer.close()


def test_a_flush_does_not_wait_for_the_batching_window(transactional_db: Any) -> None:
    """Rows wait up to the window for more to share their transaction, but a flush (shutdown,
    tests) writes them at once; rows that come meanwhile still join a batch."""
    writer = RowWriter(30.0)
    try:
        started = time.monotonic()
        for i in range(3):
            writer.upsert(Reservation, "reservation_id", reservation_row(f"res_{i}"))
        assert writer.flush(timeout=10.0)
        assert time.monotonic() - started < 5.0
        assert Reservation.objects.filter(reservation_id__startswith="res_").count() == 3
        assert writer.batches_written == 1  # the three rows in one transaction
    finally:
        writer.close()


def test_a_batch_bigger_than_a_slice_is_written_whole_in_one_transaction(transactional_db: Any) -> None:
    """A big batch is written in slices (the loop gets the GIL between them), all in one
    transaction, and no row is lost or written twice at the slices' edges."""
    writer = RowWriter(30.0)
    count = 2 * SLICE_ROWS + 5
    try:
        for i in range(count):
            writer.upsert(Reservation, "reservation_id", reservation_row(f"slice_{i}", outcome=str(i)))
        assert writer.flush(timeout=10.0)
        assert writer.batches_written == 1 and writer.rows_written == count
        rows = dict(Reservation.objects.filter(reservation_id__startswith="slice_").values_list("reservation_id", "outcome"))
        assert rows == {f"slice_{i}": str(i) for i in range(count)}
    finally:
        writer.close()


def test_only_a_batchs_first_row_wakes_the_writer(transactional_db: Any) -> None:
    """Waking the writer is a condition variable's notify: the rows that follow the first one
    within its window join the batch without waking it again; a row after the batch was taken
    wakes it for the next."""
    writer = RowWriter(30.0)
    sets = 0
    wake = writer._wakeup.set

    def counted_set() -> None:
        nonlocal sets
        sets += 1
        wake()

    writer._wakeup.set = counted_set  # type: ignore[method-assign]
    try:
        for i in range(5):
            writer.upsert(Reservation, "reservation_id", reservation_row(f"wake_{i}"))
        assert sets == 1
        assert writer.flush(timeout=10.0)  # (a flush wakes the writer itself)
        before = sets
        writer.upsert(Reservation, "reservation_id", reservation_row("wake_5"))
        assert sets == before + 1
        assert writer.flush(timeout=10.0)
        assert Reservation.objects.filter(reservation_id__startswith="wake_").count() == 6
    finally:
        writer.close()


def checked_out() -> int:
    """The pooled connections in use (PostgreSQL's pool, shared by every thread)."""
    stats = connection.pool.get_stats()
    return int(stats["pool_size"]) - int(stats["pool_available"])


def test_a_stopped_writer_gives_its_connection_back(transactional_db: Any) -> None:
    """The writer's thread keeps its connection between batches; once it stops, the connection goes
    back. Kept, every writer a test suite stopped held one of the process's pooled connections
    for good, and a later test waiting for one timed out (CI, 2026-12-06)."""
    if connection.vendor != "postgresql":
        pytest.skip("the connection pool is PostgreSQL's")
    connection.ensure_connection()
    before = checked_out()
    writer = RowWriter(0.0)
    writer.upsert(MessageRequest, "request_id", AUDIT_ROW)
    assert writer.flush()
    assert checked_out() == before + 1  # the writer's, kept between batches
    writer.close()
    assert writer._thread is not None and not writer._thread.is_alive()
    assert checked_out() == before


# --- what goes along with the rows, in their transaction -----------------------------------------


class Notes:
    """A companion that writes each kept item as a reservation row of its own (so that what it
    wrote can be read back), failing its first `failures` writes."""

    def __init__(self, failures: int = 0) -> None:
        self.kept: list[str] = []
        self.failures = failures
        self.given_back: list[list[str]] = []

    def keep(self, item: Any) -> None:
        self.kept.append(item)

    def take(self) -> Any:
        taken, self.kept = self.kept, []
        return taken or None

    def write(self, taken: Any) -> None:
        for item in taken:
            Reservation.objects.create(**reservation_row(item))
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the companion's write failed")

    def give_back(self, taken: Any) -> None:
        self.given_back.append(taken)


def test_what_goes_along_with_a_row_is_written_in_its_transaction(transactional_db: Any) -> None:
    writer = RowWriter(30.0)
    notes = Notes(failures=1)
    writer.accompany(MessageRequest, notes)
    try:
        writer.upsert(MessageRequest, "request_id", AUDIT_ROW, along="note_1")
        writer.upsert(MessageRequest, "request_id", {**AUDIT_ROW, "request_id": "req_no_note"})
        assert writer.flush(timeout=10.0)
        # The first attempt failed in the companion's write: rows and notes were rolled back
        # together, then written together once.
        assert writer.write_errors == 1 and writer.batches_written == 1
        assert MessageRequest.objects.filter(request_id__in=["req_prepared", "req_no_note"]).count() == 2
        assert list(Reservation.objects.filter(reservation_id__startswith="note_").values_list("reservation_id", flat=True)) == ["note_1"]
    finally:
        writer.close()


def test_what_is_kept_without_a_row_goes_with_the_next_batch(transactional_db: Any) -> None:
    writer = RowWriter(30.0)
    notes = Notes()
    writer.accompany(MessageRequest, notes)
    try:
        notes.keep("note_alone")
        writer.nudge()
        assert writer.flush(timeout=10.0)  # a flush waits for it, rows or not
        assert Reservation.objects.filter(reservation_id="note_alone").exists()
    finally:
        writer.close()


def test_a_batch_that_cannot_be_written_gives_back_what_went_along(transactional_db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # the retries' pauses
    writer = RowWriter(30.0)
    notes = Notes(failures=3)
    writer.accompany(MessageRequest, notes)
    try:
        writer.upsert(MessageRequest, "request_id", AUDIT_ROW, along="note_lost")
        assert writer.flush(timeout=10.0)
        assert writer.write_errors == 3 and not MessageRequest.objects.filter(request_id="req_prepared").exists()
        assert notes.given_back == [["note_lost"]] and not Reservation.objects.filter(reservation_id="note_lost").exists()
    finally:
        writer.close()
