"""`manage.py prune_audit`: retention of the request audit."""

from __future__ import annotations

import io
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from messages_api.management.commands.prune_audit import parse_age
from messages_api.models import MessageRequest, RequestStatus

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
    assert prune("--older-than", "30d", "--batch-size", "5") == "deleted 12 audit rows received before 30d ago\n"
    left = set(MessageRequest.objects.values_list("request_id", flat=True))
    assert left == {stuck.request_id, *(r.request_id for r in recent)}
    assert not left & {r.request_id for r in old}


def test_hours_and_minutes_and_dry_run() -> None:
    make("completed", timedelta(hours=3))
    make("completed", timedelta(minutes=30))
    assert prune("--older-than", "2h", "--dry-run") == "would delete 1 audit rows received before 2h ago\n"
    assert MessageRequest.objects.count() == 2
    assert prune("--older-than", "20m") == "deleted 2 audit rows received before 20m ago\n"
    assert MessageRequest.objects.count() == 0


def test_a_bad_age_is_a_command_error() -> None:
    with pytest.raises(CommandError, match="not an age"):
        prune("--older-than", "a month")
