"""`manage.py prune_audit --older-than 30d`: retention for the request audit.

Deletes finished rows (completed, failed, cancelled, rejected) received longer ago than the given
age, in batches so that no single statement holds the table (SQLite's one writer, PostgreSQL's
row locks) for long while the gateway keeps writing. In-progress rows are never deleted: crash
recovery closes them, and an operator should see a stuck one, not lose it.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from messages_api.models import MessageRequest, RequestStatus

_UNITS = {"d": "days", "h": "hours", "m": "minutes"}
_AGE = re.compile(r"^\s*(\d+)\s*([dhm])\s*$")


def parse_age(text: str) -> timedelta:
    """`30d`, `12h`, `90m` → a timedelta (days, hours, minutes)."""
    match = _AGE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not an age like 30d, 12h or 90m")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def prune(older_than: timedelta, *, batch_size: int = 5000, dry_run: bool = False) -> int:
    """Delete finished audit rows received before now - `older_than`; the number deleted."""
    cutoff = datetime.now(timezone.utc) - older_than
    expired = MessageRequest.objects.filter(received_at__lt=cutoff).exclude(status=RequestStatus.IN_PROGRESS)
    if dry_run:
        return expired.count()
    deleted = 0
    while True:
        ids = list(expired.order_by("pk").values_list("pk", flat=True)[:batch_size])
        if not ids:
            return deleted
        # Re-checked in the DELETE itself: a row cannot become in-progress again, but the filter
        # stays the one source of truth for what may go.
        count, _ = expired.filter(pk__in=ids).delete()
        deleted += count


class Command(BaseCommand):
    help = "Delete finished request audit rows older than an age (e.g. --older-than 30d); never in-progress ones."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", required=True, help="Age: a number and d (days), h (hours) or m (minutes).")
        parser.add_argument("--batch-size", type=int, default=5000, help="Rows deleted per statement (default 5000).")
        parser.add_argument("--dry-run", action="store_true", help="Only count what would be deleted.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            age = parse_age(options["older_than"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        count = prune(age, batch_size=options["batch_size"], dry_run=options["dry_run"])
        verb = "would delete" if options["dry_run"] else "deleted"
        self.stdout.write(f"{verb} {count} audit rows received before {options['older_than'].strip()} ago")
