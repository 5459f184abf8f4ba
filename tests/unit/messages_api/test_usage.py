"""Usage per API key and hour: the in-memory tally, increments from several processes adding up in
the same rows, the per-key metrics behind their setting, and the admin's page and CSV
(messages_api/usage_report.py). The charts: tests/unit/messages_api/test_usage_chart.py."""

from __future__ import annotations

import csv
import io
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client, override_settings
from prometheus_client import REGISTRY

from disagg_project import get_writer
from messages_api import usage
from messages_api.audit import AuditRecord, close_abandoned_requests
from messages_api.models import ApiKey, KeyUsage, MessageRequest, RequestStatus
from messages_api.reframe import StreamReframer
from messages_api.usage import Tally, UsageRecorder, hour_of, hour_start
from messages_api.usage_report import DAYS, HOURS, buckets

H = hour_of(datetime(2026, 12, 4, 15, 30, tzinfo=timezone.utc))


def make_key(name: str) -> ApiKey:
    return ApiKey.objects.create(name=name, key_hash=name.ljust(64, "0")[:64], prefix=name[:16])


def row(key: ApiKey, hour: int) -> KeyUsage:
    return KeyUsage.objects.get(api_key=key, hour=hour_start(hour))


# --- the tally, in memory ------------------------------------------------------------------------


def test_requests_are_tallied_per_key_and_hour() -> None:
    recorder = UsageRecorder(0)
    recorder.add("a", H, input_tokens=10, output_tokens=3, cache_read_tokens=100, queued_ms=12.5)
    recorder.add("a", H, input_tokens=1, output_tokens=2, error_type="overloaded_error")
    recorder.add("a", H + 1, output_tokens=7, error_type="overloaded_error")
    recorder.add("b", H, error_type="api_error")
    assert recorder.pending() == {
        ("a", H): Tally(2, 11, 5, 100, 12.5, {"overloaded_error": 1}),
        ("a", H + 1): Tally(1, 0, 7, 0, 0.0, {"overloaded_error": 1}),
        ("b", H): Tally(1, 0, 0, 0, 0.0, {"api_error": 1}),
    }


def test_an_ended_record_counts_in_the_hour_it_was_received() -> None:
    recorder = UsageRecorder(0)
    record = AuditRecord(api_key_name="k", received_at=datetime(2026, 12, 4, 15, 59, 59, 999999, tzinfo=timezone.utc))
    record.input_tokens, record.output_tokens, record.cache_read_input_tokens, record.queued_ms = 5, 6, 7, 8.5
    record.error_type = "timeout_error"
    recorder.note(record)
    assert recorder.pending() == {("k", H): Tally(1, 5, 6, 7, 8.5, {"timeout_error": 1})}
    assert hour_start(H) == datetime(2026, 12, 4, 15, tzinfo=timezone.utc)


def test_the_reframer_reports_cache_read_tokens_apart_from_input_tokens() -> None:
    reframer = StreamReframer(message_id="msg_1", model="m")
    assert reframer.cache_read_input_tokens == 0
    reframer.feed({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 64}}})
    assert (reframer.input_tokens, reframer.cache_read_input_tokens, reframer.output_tokens) == (36, 64, 2)


def test_audit_end_counts_keyed_requests_only(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = UsageRecorder(0)
    monkeypatch.setattr(usage, "_recorder", recorder)
    keyed = AuditRecord(api_key_name="k")
    keyed.end(RequestStatus.REJECTED, http_status=429, error_type="rate_limit_error", persist=False)
    AuditRecord().end(RequestStatus.REJECTED, http_status=401, error_type="authentication_error", persist=False)
    assert recorder.pending() == {("k", hour_of(keyed.received_at)): Tally(1, errors={"rate_limit_error": 1})}


# --- increments in the database ------------------------------------------------------------------


def test_two_processes_add_into_the_same_rows(transactional_db: Any) -> None:
    a, b = make_key("usage-a"), make_key("usage-b")
    first, second = UsageRecorder(0), UsageRecorder(0)
    first.add("usage-a", H, input_tokens=10, output_tokens=1, cache_read_tokens=4, queued_ms=1.5, error_type="api_error")
    first.add("usage-b", H, input_tokens=1)
    second.add("usage-a", H, input_tokens=20, output_tokens=2, queued_ms=2.0, error_type="api_error")
    second.add("usage-a", H, error_type="overloaded_error")
    second.add("usage-a", H + 1, output_tokens=9)
    assert first.flush() and second.flush()
    assert first.pending() == {} and second.pending() == {}

    got = row(a, H)
    assert (got.requests, got.input_tokens, got.output_tokens, got.cache_read_tokens, got.queued_ms_total) == (3, 30, 3, 4, 3.5)
    assert got.errors == {"api_error": 2, "overloaded_error": 1}
    assert (row(a, H + 1).requests, row(a, H + 1).output_tokens, row(a, H + 1).errors) == (1, 9, {})
    assert (row(b, H).requests, row(b, H).input_tokens) == (1, 1)

    # Later intervals add to the rows already there.
    first.add("usage-a", H, input_tokens=5, error_type="overloaded_error")
    assert first.flush()
    got = row(a, H)
    assert (got.requests, got.input_tokens, got.errors) == (4, 35, {"api_error": 2, "overloaded_error": 2})
    assert KeyUsage.objects.count() == 3


def test_concurrent_flushes_from_many_recorders_lose_nothing(transactional_db: Any) -> None:
    make_key("busy-1")
    make_key("busy-2")
    recorders = [UsageRecorder(0) for _ in range(3)]
    rounds, per_round = 15, 20

    def process(recorder: UsageRecorder, index: int) -> None:
        for r in range(rounds):
            for i in range(per_round):
                recorder.add(f"busy-{1 + i % 2}", H + i % 3, input_tokens=1, output_tokens=2, queued_ms=0.5,
                             error_type="api_error" if i % 5 == 0 else "")  # fmt: skip
            assert recorder.flush(), f"recorder {index} round {r}"

    threads = [threading.Thread(target=process, args=(recorder, i)) for i, recorder in enumerate(recorders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(recorder.write_errors == 0 and recorder.pending() == {} for recorder in recorders)
    total = len(recorders) * rounds * per_round
    rows = list(KeyUsage.objects.all())
    assert sum(r.requests for r in rows) == total
    assert sum(r.input_tokens for r in rows) == total and sum(r.output_tokens for r in rows) == 2 * total
    assert sum(r.queued_ms_total for r in rows) == pytest.approx(0.5 * total)
    assert sum(r.errors.get("api_error", 0) for r in rows) == total // 5
    assert len(rows) == 6  # 2 keys × 3 hours


def test_a_failed_write_keeps_the_counts_for_the_next(transactional_db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_key("flaky")
    recorder = UsageRecorder(0)
    recorder.add("flaky", H, input_tokens=3)
    real_write = recorder._write

    def failing(batch: Any) -> None:
        raise RuntimeError("database away")

    monkeypatch.setattr(recorder, "_write", failing)
    assert not recorder.flush()
    recorder.add("flaky", H, input_tokens=4)  # arrives while the first write failed
    monkeypatch.setattr(recorder, "_write", real_write)
    assert recorder.flush()
    got = row(key, H)
    assert (got.requests, got.input_tokens) == (2, 7)
    assert recorder.write_errors == 1


def test_an_unknown_key_is_dropped_and_the_rest_written(transactional_db: Any) -> None:
    key = make_key("kept")
    recorder = UsageRecorder(0)
    recorder.add("gone", H)
    recorder.add("kept", H)
    assert recorder.flush()
    assert row(key, H).requests == 1 and KeyUsage.objects.count() == 1
    assert recorder.dropped_keys == 1


def test_a_request_is_counted_under_its_key_id_whatever_the_key_is_renamed_to(transactional_db: Any) -> None:
    key = make_key("before-rename")
    recorder = UsageRecorder(0)
    record = AuditRecord(api_key_name="before-rename", api_key_id=key.pk, received_at=hour_start(H) + timedelta(minutes=1))
    record.output_tokens = 5
    recorder.note(record)
    ApiKey.objects.filter(pk=key.pk).update(name="after-rename")  # renamed before the tally is written
    recorder.add(key.pk + 1000, H)  # an id no key has (deleted meanwhile): dropped, the rest written
    assert recorder.flush()
    assert (row(key, H).requests, row(key, H).output_tokens) == (1, 5)
    assert recorder.dropped_keys == 1


def test_the_writer_thread_flushes_on_its_own(transactional_db: Any) -> None:
    key = make_key("threaded")
    recorder = UsageRecorder(0.05)
    recorder.add("threaded", H, output_tokens=2)
    try:
        deadline = datetime.now() + timedelta(seconds=10)
        while not KeyUsage.objects.filter(api_key=key).exists() and datetime.now() < deadline:
            threading.Event().wait(0.05)
        assert row(key, H).output_tokens == 2
    finally:
        recorder.close()
    assert recorder._thread is not None
    recorder._thread.join(5)
    assert not recorder._thread.is_alive()


# --- usage with the audit rows: one transaction, and the recovery sweep ------------------------


def keyed_record(key: ApiKey, request_id: str) -> AuditRecord:
    record = AuditRecord(request_id=request_id, api_key_name=key.name, api_key_id=key.pk, received_at=hour_start(H) + timedelta(minutes=5))
    record.input_tokens, record.cache_creation_input_tokens, record.output_tokens, record.cache_read_input_tokens = 10, 2, 7, 30
    record.queued_ms = 4.0
    return record


def test_a_requests_usage_is_written_with_its_terminal_row(transactional_db: Any) -> None:
    key = make_key("with-rows")
    record = keyed_record(key, "req_with_rows")
    record.begin()
    record.end(RequestStatus.COMPLETED, http_status=200)
    assert get_writer().flush()
    assert usage.get_recorder().pending() == {}  # taken by the writer with the row
    assert MessageRequest.objects.get(request_id="req_with_rows").status == "completed"
    got = row(key, H)
    assert (got.requests, got.input_tokens, got.output_tokens, got.cache_read_tokens, got.queued_ms_total, got.errors) == (1, 12, 7, 30, 4.0, {})


def test_a_refusal_without_a_row_is_written_with_the_next_batch(transactional_db: Any) -> None:
    key = make_key("refused")
    AuditRecord(api_key_name=key.name, api_key_id=key.pk, received_at=hour_start(H)).end(
        RequestStatus.REJECTED, http_status=429, error_type="rate_limit_error", persist=False
    )
    assert get_writer().flush()
    assert (row(key, H).requests, row(key, H).errors) == (1, {"rate_limit_error": 1})


def test_the_recovery_sweep_counts_the_rows_it_closes_once(transactional_db: Any) -> None:
    key = make_key("abandoned")
    for i in range(3):
        record = keyed_record(key, f"req_abandoned_{i}")
        record.output_tokens = i  # as far as it came
        row_values = {**record.row(), "gateway_instance": "dead-host:1:x"}
        MessageRequest.objects.create(**row_values)
    MessageRequest.objects.create(**{**keyed_record(key, "req_done").row(), "status": "completed", "gateway_instance": "dead-host:1:x"})
    for _ in range(2):  # a second sweep (another process's) finds nothing more to count
        close_abandoned_requests(None, instances=["dead-host:1:x"], reason="the gateway process handling this request died")
    assert set(MessageRequest.objects.filter(request_id__startswith="req_abandoned_").values_list("status", flat=True)) == {"failed"}
    got = row(key, H)
    assert (got.requests, got.input_tokens, got.output_tokens, got.errors) == (3, 36, 0 + 1 + 2, {"api_error": 3})


# --- per-key metrics -----------------------------------------------------------------------------


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("enabled", [False, True])
def test_per_key_metrics_only_when_enabled(enabled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage, "_recorder", UsageRecorder(0))
    key = f"metrics-key-{enabled}"
    before = sample("gateway_key_requests_total", key=key, status="completed")
    record = AuditRecord(api_key_name=key)
    record.input_tokens, record.output_tokens, record.cache_read_input_tokens = 10, 20, 30
    with override_settings(METRICS_PER_KEY_LABELS=enabled):
        record.end(RequestStatus.COMPLETED, http_status=200, persist=False)
    assert sample("gateway_key_requests_total", key=key, status="completed") - before == (1.0 if enabled else 0.0)
    for kind, tokens in (("input", 10), ("output", 20), ("cache_read", 30)):
        assert sample("gateway_key_tokens_total", key=key, kind=kind) == (tokens if enabled else 0.0)


# --- the admin's page and CSV --------------------------------------------------------------------


def now_hour() -> datetime:
    return datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)


@pytest.fixture
def used_key(db: Any) -> ApiKey:
    key = make_key("tenant <one>")
    this_hour = now_hour()
    two_days_ago = this_hour - timedelta(days=2)
    KeyUsage.objects.create(api_key=key, hour=this_hour, requests=7, input_tokens=700, output_tokens=70, cache_read_tokens=7000,
                            errors={"overloaded_error": 2}, queued_ms_total=35.0)  # fmt: skip
    KeyUsage.objects.create(api_key=key, hour=this_hour - timedelta(hours=3), requests=1, input_tokens=5)
    KeyUsage.objects.create(api_key=key, hour=two_days_ago, requests=4, output_tokens=40, errors={"api_error": 1})
    KeyUsage.objects.create(api_key=key, hour=two_days_ago + timedelta(hours=1), requests=6, output_tokens=60)
    KeyUsage.objects.create(api_key=key, hour=this_hour - timedelta(days=45), requests=99)  # out of both ranges
    other = make_key("someone else")
    KeyUsage.objects.create(api_key=other, hour=this_hour, requests=1000)
    return key


def staff_client(*, view: bool = True) -> Client:
    user = get_user_model().objects.create_user("staff", "staff@example.com", "pw", is_staff=True)
    if view:
        user.user_permissions.add(Permission.objects.get(codename="view_apikey"))
    client = Client()
    client.force_login(user)
    return client


def read_csv(client: Client, key: ApiKey, period: str) -> list[dict[str, str]]:
    response = client.get(f"/admin/messages_api/apikey/{key.pk}/usage/{period}.csv")
    assert response.status_code == 200, response.content[:500]
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"] == f'attachment; filename="usage-tenant-one-{period}.csv"'
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def test_the_csv_of_24_hours_and_30_days(used_key: ApiKey) -> None:
    client = staff_client()
    hours = read_csv(client, used_key, "hours")
    assert len(hours) == 24
    assert hours[-1] == {
        "start_utc": now_hour().strftime("%Y-%m-%dT%H:00:00Z"), "requests": "7", "input_tokens": "700", "output_tokens": "70",
        "cache_read_tokens": "7000", "errors": "2", "queued_ms_total": "35.0", "queued_ms_mean": "5.0", "errors:overloaded_error": "2",
    }  # fmt: skip
    assert hours[-4]["requests"] == "1" and hours[-4]["input_tokens"] == "5"
    assert sum(int(h["requests"]) for h in hours) == 8
    assert [h["start_utc"] for h in hours] == sorted(h["start_utc"] for h in hours)

    days = read_csv(client, used_key, "days")
    assert len(days) == 30
    assert days[-1]["start_utc"] == now_hour().strftime("%Y-%m-%dT00:00:00Z")
    assert list(days[0]) == [
        "start_utc", "requests", "input_tokens", "output_tokens", "cache_read_tokens", "errors", "queued_ms_total", "queued_ms_mean",
        "errors:api_error", "errors:overloaded_error",
    ]  # fmt: skip
    two_days_ago = (now_hour() - timedelta(days=2)).strftime("%Y-%m-%dT00:00:00Z")
    (day,) = [d for d in days if d["start_utc"] == two_days_ago]
    # The two hours of that day are summed (the second may fall on the next day just after midnight).
    if (now_hour() - timedelta(days=2)).hour == 23:
        assert day["requests"] == "4"
    else:
        assert (day["requests"], day["output_tokens"], day["errors"], day["errors:api_error"]) == ("10", "100", "1", "1")
    assert sum(int(d["requests"]) for d in days) == 18  # not the 45-day-old hour, not the other key's


def test_the_usage_page_charts_both_ranges(used_key: ApiKey) -> None:
    client = staff_client()
    change = client.get(f"/admin/messages_api/apikey/{used_key.pk}/change/")
    assert f'href="/admin/messages_api/apikey/{used_key.pk}/usage/"' in change.content.decode()
    page = client.get(f"/admin/messages_api/apikey/{used_key.pk}/usage/")
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count("<svg class=\"usage-chart\"") == 6
    assert "tenant &lt;one&gt;" in html and "tenant <one>" not in html
    assert 'data-series="requests" data-value="7"' in html and 'data-series="cache read" data-value="7000"' in html
    assert f'/admin/messages_api/apikey/{used_key.pk}/usage/hours.csv' in html
    assert f'/admin/messages_api/apikey/{used_key.pk}/usage/days.csv' in html
    assert "overloaded_error" in html and "api_error" in html


def test_the_usage_pages_need_staff_and_view_permission(used_key: ApiKey) -> None:
    url = f"/admin/messages_api/apikey/{used_key.pk}/usage/hours.csv"
    anonymous = Client().get(url)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    assert staff_client(view=False).get(url).status_code == 403


def test_an_unknown_key_or_period_is_not_found(used_key: ApiKey) -> None:
    client = staff_client()
    assert client.get("/admin/messages_api/apikey/999999/usage/").status_code == 404
    assert client.get(f"/admin/messages_api/apikey/{used_key.pk}/usage/weeks.csv").status_code == 404


def test_buckets_sum_hours_into_days(used_key: ApiKey) -> None:
    now = now_hour() + timedelta(minutes=30)
    hours = buckets(used_key.pk, HOURS, now)
    days = buckets(used_key.pk, DAYS, now)
    assert len(hours) == 24 and hours[-1].start == now_hour() and hours[0].start == now_hour() - timedelta(hours=23)
    assert len(days) == 30 and days[-1].start == now_hour().replace(hour=0)
    assert sum(b.requests for b in days) == 18 and sum(b.requests for b in hours) == 8
