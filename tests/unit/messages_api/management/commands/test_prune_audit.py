"""`manage.py prune_audit`: retention of the request audit."""

from __future__ import annotations

import io
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from messages_api.management.commands.prune_audit import parse_age
from messages_api.models import ApiKey, KeyUsage, MessageRequest, RequestStatus

pytestmark = pytest.mark.django_db


def make(status: str, age: timedelta) -> MessageRequest:
    return MessageRequest.objects.create(
        request_id="req_" + uuid.uuid4().hex[:24], received_at=datetime.now(timezone.utc) - age, status=status
    )


def prune(*args: str) -> str:
    out = io.StringIO()
    call_command("prune_audit", *args, stdout=out)
    return out.getvalue()


def test_parse_age_units() -> None:
    assert parse_age("30d") == timedelta(days=30)
    assert parse_age("12h") == timedelta(hours=12)
    assert parse_age(" 90m ") == timedelta(minutes=90)
    for bad in ("30", "d", "3w", "-1d", "1.5h", ""):
        with pytest.raises(ValueError):
            parse_age(bad)


def test_deletes_old_finished_rows_in_batches_and_keeps_the_rest() -> None:
    old = [make(status, timedelta(days=31)) for status in ("completed", "failed", "cancelled", "rejected") for _ in range(3)]
    stuck = make(RequestStatus.IN_PROGRESS, timedelta(days=90))
    recent = [make("completed", timedelta(days=29)), make("rejected", timedelta(hours=1))]
    with override_settings(USAGE_HOURS_RETENTION_DAYS=90):
        assert prune("--older-than", "30d", "--batch-size", "5") == (
            "deleted 12 audit rows received before 30d ago\ndeleted 0 hourly usage rows before 90d ago\n"
        )
    left = set(MessageRequest.objects.values_list("request_id", flat=True))
    assert left == {stuck.request_id, *(r.request_id for r in recent)}
    assert not left & {r.request_id for r in old}


def test_hours_and_minutes_and_dry_run() -> None:
    make("completed", timedelta(hours=3))
    make("completed", timedelta(minutes=30))
    assert prune("--older-than", "2h", "--dry-run").startswith("would delete 1 audit rows received before 2h ago\n")
    assert MessageRequest.objects.count() == 2
    assert prune("--older-than", "20m").startswith("deleted 2 audit rows received before 20m ago\n")
    assert MessageRequest.objects.count() == 0


def test_a_bad_age_is_a_command_error() -> None:
    with pytest.raises(CommandError, match="not an age"):
        prune("--older-than", "a month")


def usage_hours(key: ApiKey, *days_ago: int) -> None:
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    for days in days_ago:
        KeyUsage.objects.create(api_key=key, hour=hour - timedelta(days=days), requests=1)


def test_hourly_usage_beyond_its_retention_goes_too() -> None:
    key = ApiKey.objects.create(name="k", key_hash="0" * 64, prefix="p")
    usage_hours(key, 0, 30, 40, 91, 200)
    with override_settings(USAGE_HOURS_RETENTION_DAYS=90):
        assert prune("--older-than", "30d", "--dry-run").endswith("would delete 2 hourly usage rows before 90d ago\n")
        assert KeyUsage.objects.count() == 5
        assert prune("--older-than", "30d", "--batch-size", "1").endswith("deleted 2 hourly usage rows before 90d ago\n")
    assert KeyUsage.objects.count() == 3
    assert prune("--older-than", "30d", "--usage-older-than", "35d").endswith("deleted 1 hourly usage rows before 35d ago\n")
    assert KeyUsage.objects.count() == 2


def test_hourly_usage_is_kept_at_least_31_days() -> None:
    with pytest.raises(CommandError, match="at least 31d"):
        prune("--older-than", "30d", "--usage-older-than", "30d")
    with override_settings(USAGE_HOURS_RETENTION_DAYS=7), pytest.raises(CommandError, match="at least 31d"):
        prune("--older-than", "30d")
