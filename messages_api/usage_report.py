"""An API key's usage in the admin: the last 24 hours by hour and the last 30 days by day, as
charts (messages_api/usage_chart.py) and as CSV.

    /admin/messages_api/apikey/<id>/usage/            the page (linked from the key's change page)
    /admin/messages_api/apikey/<id>/usage/hours.csv   the 24 hours, one row per hour
    /admin/messages_api/apikey/<id>/usage/days.csv    the 30 days, one row per day

Staff only (the admin's login), and only for those who may view API keys. All times are UTC. A
day is the sum of its hours (`KeyUsage` rows), added up here: at most 30 × 24 rows per page.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from django.conf import settings
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.text import slugify

from messages_api.models import ApiKey, KeyUsage
from messages_api.usage import Tally
from messages_api.usage_chart import BLUE, GREEN, ORANGE, RED, TEAL, Series, chart, figures


@dataclass(slots=True)
class Bucket(Tally):
    """A key's use in one hour or one day."""

    start: datetime = field(kw_only=True)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def queued_ms_mean(self) -> float:
        return self.queued_ms_total / self.requests if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class Period:
    slug: str
    title: str
    count: int
    step: timedelta
    label: str  # strftime of a bucket on the x axis
    hover: str  # strftime of a bucket in a point's title and the CSV

    def starts(self, now: datetime) -> list[datetime]:
        last = now.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)
        if self.step >= timedelta(days=1):
            last = last.replace(hour=0)
        return [last - self.step * (self.count - 1 - i) for i in range(self.count)]

    def bucket_of(self, hour: datetime) -> datetime:
        hour = hour.astimezone(timezone.utc)
        return hour.replace(hour=0) if self.step >= timedelta(days=1) else hour


HOURS = Period("hours", "Last 24 hours, by hour", 24, timedelta(hours=1), "%H:00", "%Y-%m-%d %H:00 UTC")
DAYS = Period("days", "Last 30 days, by day", 30, timedelta(days=1), "%m-%d", "%Y-%m-%d")
PERIODS = {period.slug: period for period in (HOURS, DAYS)}


def buckets(key_id: int, period: Period, now: datetime | None = None) -> list[Bucket]:
    """The key's use in each of the period's buckets, oldest first, empty ones included."""
    starts = period.starts(now or datetime.now(timezone.utc))
    by_start = {start: Bucket(start=start) for start in starts}
    rows = KeyUsage.objects.filter(api_key_id=key_id, hour__gte=starts[0]).values_list(
        "hour", "requests", "input_tokens", "output_tokens", "cache_read_tokens", "queued_ms_total", "errors"
    )
    for hour, requests, input_tokens, output_tokens, cache_read_tokens, queued_ms_total, errors in rows:
        bucket = by_start.get(period.bucket_of(hour))
        if bucket is None:  # an hour after now: another process's clock runs ahead
            continue
        errors = {error_type: int(count) for error_type, count in (errors or {}).items()}
        bucket.add(Tally(requests, input_tokens, output_tokens, cache_read_tokens, queued_ms_total, errors))
    return list(by_start.values())


def total(of: list[Bucket]) -> Bucket:
    whole = Bucket(start=of[0].start if of else datetime.now(timezone.utc))
    for bucket in of:
        whole.add(bucket)
    return whole


CSV_COLUMNS = ("start_utc", "requests", "input_tokens", "output_tokens", "cache_read_tokens", "errors", "queued_ms_total", "queued_ms_mean")


def write_csv(out: Any, period: Period, rows: list[Bucket]) -> None:
    """One line per bucket; after the fixed columns one `errors:<type>` column per error type
    seen in the period."""
    error_types = sorted({error_type for bucket in rows for error_type in bucket.errors})
    writer = csv.writer(out)
    writer.writerow([*CSV_COLUMNS, *(f"errors:{t}" for t in error_types)])
    for bucket in rows:
        writer.writerow([
            bucket.start.strftime("%Y-%m-%dT%H:%M:%SZ"), bucket.requests, bucket.input_tokens, bucket.output_tokens,
            bucket.cache_read_tokens, bucket.error_count, round(bucket.queued_ms_total, 3), round(bucket.queued_ms_mean, 3),
            *(bucket.errors.get(t, 0) for t in error_types),
        ])  # fmt: skip


def section(api_key: ApiKey, period: Period, rows: list[Bucket]) -> dict[str, Any]:
    """What the page shows of one period: its figures, charts, errors by type and CSV link."""
    labels = [b.start.strftime(period.label) for b in rows]
    hover = [b.start.strftime(period.hover) for b in rows]

    def values(of: Callable[[Bucket], float]) -> list[float]:
        return [float(of(b)) for b in rows]

    whole = total(rows)
    share = f" ({whole.error_count / whole.requests:.1%})" if whole.requests else ""
    return {
        "slug": period.slug,
        "title": period.title,
        "csv_url": reverse("admin:messages_api_apikey_usage_csv", args=[api_key.pk, period.slug]),
        "figures": figures([
            ("requests", f"{whole.requests:,}"),
            ("input tokens", f"{whole.input_tokens:,}"),
            ("output tokens", f"{whole.output_tokens:,}"),
            ("cache-read tokens", f"{whole.cache_read_tokens:,}"),
            ("errors", f"{whole.error_count:,}{share}"),
            ("time queued", f"{whole.queued_ms_total / 1000:,.1f} s (mean {whole.queued_ms_mean:,.0f} ms)"),
        ]),  # fmt: skip
        "errors": sorted(whole.errors.items(), key=lambda item: (-item[1], item[0])),
        "charts": [
            chart(
                f"Requests and errors, {period.title.lower()}", labels,
                [Series("requests", BLUE, values(lambda b: b.requests)), Series("errors", RED, values(lambda b: b.error_count))],
                kind="overlaid bars", hover_labels=hover,
            ),
            chart(
                f"Tokens, {period.title.lower()}", labels,
                [
                    Series("input", TEAL, values(lambda b: b.input_tokens), "tokens"),
                    Series("output", ORANGE, values(lambda b: b.output_tokens), "tokens"),
                    Series("cache read", GREEN, values(lambda b: b.cache_read_tokens), "tokens"),
                ],
                kind="lines", hover_labels=hover,
            ),
            chart(
                f"Mean time queued per request, {period.title.lower()}", labels,
                [Series("ms queued per request", BLUE, values(lambda b: b.queued_ms_mean), "ms")],
                kind="bars", hover_labels=hover,
            ),
        ],  # fmt: skip
    }


class KeyUsagePages(admin.ModelAdmin[ApiKey]):
    """The API key admin's usage page and CSV downloads (ApiKeyAdmin derives from this)."""

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("<int:object_id>/usage/", wrap(self.usage_view), name="messages_api_apikey_usage"),
            path("<int:object_id>/usage/<slug:period>.csv", wrap(self.usage_csv_view), name="messages_api_apikey_usage_csv"),
            *super().get_urls(),
        ]

    def usage_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        api_key = self._viewable_key(request, object_id)
        now = datetime.now(timezone.utc)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Usage of {api_key.name}",
            "subtitle": None,
            "opts": self.opts,
            "original": api_key,
            "sections": [section(api_key, period, buckets(api_key.pk, period, now)) for period in (HOURS, DAYS)],
            "flush_interval": settings.AUDIT_FLUSH_INTERVAL_S,
            "now": now,
        }
        return TemplateResponse(request, "admin/messages_api/apikey/usage.html", context)

    def usage_csv_view(self, request: HttpRequest, object_id: int, period: str) -> HttpResponse:
        api_key = self._viewable_key(request, object_id)
        chosen = PERIODS.get(period)
        if chosen is None:
            raise Http404(f"no usage period {period!r}: hours or days")
        response = HttpResponse(content_type="text/csv; charset=utf-8")
        name = slugify(api_key.name) or str(api_key.pk)
        response["Content-Disposition"] = f'attachment; filename="usage-{name}-{chosen.slug}.csv"'
        write_csv(response, chosen, buckets(api_key.pk, chosen))
        return response

    def _viewable_key(self, request: HttpRequest, object_id: int) -> ApiKey:
        api_key = self.get_object(request, str(object_id))
        if api_key is None:
            raise Http404("no such API key")
        if not self.has_view_permission(request, api_key):
            raise PermissionDenied
        return api_key
