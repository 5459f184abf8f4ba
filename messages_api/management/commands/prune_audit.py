"""`manage.py prune_audit --older-than 30d`: retention for the request audit and hourly usage.

Deletes finished rows (completed, failed, cancelled, rejected) received longer ago than the given
age, in batches so that no single statement holds the table (SQLite's one writer, PostgreSQL's
row locks) for long while the gateway keeps writing. In-progress rows are never deleted: crash
recovery closes them, and an operator should see a stuck one, not lose it.

Also deletes hourly usage (`KeyUsage`) older than USAGE_HOURS_RETENTION_DAYS, or
`--usage-older-than`: never less than 31 days, since the admin charts the last 30 days and a day
is the sum of its hours.

And archives Message Batches created more than BATCH_RESULTS_RETENTION_S ago (Anthropic keeps
results 29 days): the batch stays visible with `archived_at` set, its items and results are
deleted (messages_api/batches/store.py `archive`).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Model, QuerySet

from messages_api.batches.store import archive
from messages_api.models import KeyUsage, MessageRequest, RequestStatus

_UNITS = {"d": "days", "h": "hours", "m": "minutes"}
_AGE = re.compile(r"^\s*(\d+)\s*([dhm])\s*$")
# The least hourly usage kept: the admin's 30-day chart sums the hours of the last 30 UTC days.
MIN_USAGE_AGE = timedelta(days=31)


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
    return _delete_in_batches(expired, batch_size, dry_run)


def prune_usage(older_than: timedelta, *, batch_size: int = 5000, dry_run: bool = False) -> int:
    """Delete hourly usage rows of hours that began before now - `older_than`; the number deleted."""
    if older_than < MIN_USAGE_AGE:
        raise ValueError(f"hourly usage is kept at least {MIN_USAGE_AGE.days} days (the admin charts 30)")
    cutoff = datetime.now(timezone.utc) - older_than
    return _delete_in_batches(KeyUsage.objects.filter(hour__lt=cutoff), batch_size, dry_run)


def _delete_in_batches(expired: QuerySet[Model], batch_size: int, dry_run: bool) -> int:
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
    help = (
        "Delete finished request audit rows older than an age (e.g. --older-than 30d), never in-progress ones; "
        "and hourly usage older than USAGE_HOURS_RETENTION_DAYS (or --usage-older-than); "
        "archive Message Batches older than BATCH_RESULTS_RETENTION_S (their results deleted)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", required=True, help="Age: a number and d (days), h (hours) or m (minutes).")
        parser.add_argument("--batch-size", type=int, default=5000, help="Rows deleted per statement (default 5000).")
        parser.add_argument("--dry-run", action="store_true", help="Only count what would be deleted.")
        parser.add_argument(
            "--usage-older-than",
            help="Age of the hourly usage to delete (at least 31d; default: USAGE_HOURS_RETENTION_DAYS days).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        usage_age_text = options["usage_older_than"] or f"{settings.USAGE_HOURS_RETENTION_DAYS}d"
        try:
            age = parse_age(options["older_than"])
            usage_age = parse_age(usage_age_text)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        if usage_age < MIN_USAGE_AGE:
            raise CommandError(
                f"hourly usage is kept at least {MIN_USAGE_AGE.days}d (the admin charts the last 30 days); got {usage_age_text.strip()}"
            )
        count = prune(age, batch_size=options["batch_size"], dry_run=options["dry_run"])
        usage_count = prune_usage(usage_age, batch_size=options["batch_size"], dry_run=options["dry_run"])
        verb = "would delete" if options["dry_run"] else "deleted"
        self.stdout.write(f"{verb} {count} audit rows received before {options['older_than'].strip()} ago")
        self.stdout.write(f"{verb} {usage_count} hourly usage rows before {usage_age_text.strip()} ago")
        batches = archive(timedelta(seconds=settings.BATCH_RESULTS_RETENTION_S), dry_run=options["dry_run"])
        if batches:
            self.stdout.write(f"{'would archive' if options['dry_run'] else 'archived'} {batches} message batches (their results)")
