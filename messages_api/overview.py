"""The admin's cluster overview: per pool and endpoint what the cluster is doing now, the last
15 minutes of traffic from the audit, and the last failed requests.

    /admin/overview/        the page (linked from the admin's index and sidebar)
    /admin/overview/live/   its live part alone, fetched every few seconds by the page's script
                            (messages_api/static/messages_api/admin/overview.js) and swapped in

Where each number comes from:

- **every gateway process** (the database): endpoint health as the probes last wrote it, open
  reservation rows, the audit rows (requests per minute, errors by type, time to first token,
  failed requests), the processes' heartbeats, the Message Batches in progress and their items;
- **this process only** (its memory): the circuit breakers, its own probes, the reservations it
  holds, the requests waiting in its admission queue, each engine's queue and KV use as it last
  reported them here (`workers.local_state`). Another process
  may see an endpoint's breaker open while this one does not; the page says which is which.

Cheap by construction: about eight queries, each bounded by the 15-minute window on indexed
columns (`received_at`, `status`), the open reservations (`released_at`), or the small cluster
tables; the time-to-first-token percentiles read at most `TTFT_SAMPLE` values (the newest).
Nothing secret is read: pools are loaded without their signing key.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from django.conf import settings
from django.db.models import Count
from django.db.models.functions import TruncMinute
from django.http import HttpRequest
from django.urls import reverse
from django.utils.safestring import SafeString

from messages_api.models import BatchItem, BatchStatus, ItemState, MessageBatch, MessageRequest, RequestStatus
from messages_api.usage_chart import BLUE, ORANGE, RED, Series, chart
from workers import Priority, local_state
from workers.models import GatewayProcess, Reservation, WorkerEndpoint, WorkerPool

WINDOW_MINUTES = 15
# The newest first-token times read for the percentiles (a busier window is sampled, and says so).
TTFT_SAMPLE = 20_000
FAILED_SHOWN = 12
FAILED_LOOKBACK = timedelta(hours=24)
REFRESH_S = 5.0
PRIORITIES = [p.label for p in Priority]
ROLES = ("context", "generation")


# --- who may see what -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Access:
    cluster: bool  # pools and endpoints
    traffic: bool  # the audit: rates, errors, failed requests
    audit_rows: bool  # links to audit rows
    pools: bool  # links to pool pages
    endpoints: bool  # links to endpoint pages

    @property
    def anything(self) -> bool:
        return self.cluster or self.traffic


def access(request: HttpRequest) -> Access:
    user = request.user
    pools = user.has_perm("workers.view_workerpool") or user.has_perm("workers.change_workerpool")
    endpoints = user.has_perm("workers.view_workerendpoint") or user.has_perm("workers.change_workerendpoint")
    audit = user.has_perm("messages_api.view_messagerequest")
    return Access(cluster=pools or endpoints, traffic=audit, audit_rows=audit, pools=pools, endpoints=endpoints)


# --- numbers ------------------------------------------------------------------------------------


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None for none)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f} ms" if value < 10_000 else f"{value / 1000:,.1f} s"


def share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "—"


def _url(at: str) -> str:
    return at.rstrip("/")


@dataclass(slots=True)
class Tally:
    """Requests in a window: counts by status, errors by type, first-token times."""

    requests: int = 0
    by_status: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ttft: list[float] = field(default_factory=list)

    def add(self, status: str, error_type: str, n: int) -> None:
        self.requests += n
        self.by_status[status] += n
        if error_type and status in (RequestStatus.FAILED, RequestStatus.REJECTED):
            self.errors[error_type] += n

    @property
    def failed(self) -> int:
        return self.by_status.get(RequestStatus.FAILED, 0)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def percentiles(self) -> tuple[float | None, float | None]:
        values = sorted(self.ttft)
        return percentile(values, 0.5), percentile(values, 0.99)


@dataclass(slots=True)
class Traffic:
    since: datetime
    minutes: float  # how long the window is so far (between WINDOW_MINUTES - 1 and WINDOW_MINUTES)
    buckets: list[datetime]
    total: Tally
    by_minute: dict[datetime, Tally]
    by_pool: dict[str, Tally]
    error_statuses: dict[str, dict[str, int]]  # error type → status → requests
    sampled: bool  # the first-token times were capped at TTFT_SAMPLE

    def rate(self, tally: Tally) -> float:
        return tally.requests / self.minutes if self.minutes else 0.0


def traffic(now: datetime) -> Traffic:
    """The audit of the last WINDOW_MINUTES minutes (the current one so far included)."""
    this_minute = now.replace(second=0, microsecond=0)
    buckets = [this_minute - timedelta(minutes=WINDOW_MINUTES - 1 - i) for i in range(WINDOW_MINUTES)]
    since = buckets[0]
    result = Traffic(
        since=since, minutes=max((now - since).total_seconds() / 60, 1e-9), buckets=buckets, total=Tally(),
        by_minute={b: Tally() for b in buckets}, by_pool=defaultdict(Tally), error_statuses=defaultdict(lambda: defaultdict(int)),
        sampled=False,
    )  # fmt: skip
    window = MessageRequest.objects.filter(received_at__gte=since)
    counts = (
        window.annotate(minute=TruncMinute("received_at", tzinfo=timezone.utc))
        .values_list("minute", "pool_name", "status", "error_type")
        .annotate(n=Count("id"))
        .order_by()
    )
    for minute, pool_name, status, error_type, n in counts:
        result.total.add(status, error_type, n)
        bucket = result.by_minute.get(minute)
        if bucket is not None:  # a row stamped after now: another process's clock runs ahead
            bucket.add(status, error_type, n)
        if pool_name:
            result.by_pool[pool_name].add(status, error_type, n)
        if error_type and status in (RequestStatus.FAILED, RequestStatus.REJECTED):
            result.error_statuses[error_type][status] += n
    firsts = list(
        window.filter(first_token_ms__isnull=False)
        .order_by("-received_at")
        .values_list("received_at", "pool_name", "first_token_ms")[:TTFT_SAMPLE]
    )
    result.sampled = len(firsts) >= TTFT_SAMPLE
    for received_at, pool_name, first_token_ms in firsts:
        if first_token_ms is None:  # filtered out above; for the type checker
            continue
        result.total.ttft.append(first_token_ms)
        bucket = result.by_minute.get(received_at.replace(second=0, microsecond=0))
        if bucket is not None:
            bucket.ttft.append(first_token_ms)
        if pool_name:
            result.by_pool[pool_name].ttft.append(first_token_ms)
    return result


def endpoint_traffic(since: datetime) -> dict[tuple[str, str], tuple[int, int]]:
    """(role, endpoint URL) → (requests it served in the window, those that failed in its stage)."""
    served: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    rows = (
        MessageRequest.objects.filter(received_at__gte=since)
        .values_list("stage", "status", "context_endpoint", "generation_endpoint")
        .annotate(n=Count("id"))
        .order_by()
    )
    for stage, status, context, generation, n in rows:
        for role, url in (("context", context), ("generation", generation)):
            if url:
                counts = served[(role, _url(url))]
                counts[0] += n
                if status == RequestStatus.FAILED and stage == role:
                    counts[1] += n
    return {key: (a, b) for key, (a, b) in served.items()}


# --- the cluster ----------------------------------------------------------------------------------


@dataclass(slots=True)
class EndpointRow:
    id: int
    role: str
    url: str
    change_url: str | None
    state: str  # serving, draining, disabled
    healthy: bool
    last_error: str
    checked: str
    probed_here: bool | None
    breaker: str
    open_all: int
    capacity: int | None
    capacity_tokens: int | None
    open_here: int
    tokens_here: int
    requests: int | None
    failed: int | None
    #: The engine's own load as this process last had it (`workers.local_state`), and why its last
    #: read here failed.
    engine: Any = None
    engine_error: str = ""
    #: Its KV-cache events as this process follows them (`KvEvents.summary`; None: not subscribed).
    kv_events: Any = None

    @property
    def breaker_label(self) -> str:
        return self.breaker.replace("_", "-")

    @property
    def full(self) -> bool:
        return self.capacity is not None and self.open_all >= self.capacity


@dataclass(slots=True)
class PoolRow:
    id: int
    name: str
    model: str
    protocol: str
    routing: str
    schedule_style: str
    change_url: str | None
    endpoints: list[EndpointRow]
    queued: dict[str, dict[str, int]]  # role → priority → waiting here
    routable: dict[str, tuple[int, int]]  # role → (routable, registered), as the database says
    figures: list[tuple[str, str]]


def _ago(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "never checked"
    seconds = max(0, int((now - when).total_seconds()))
    return f"checked {seconds} s ago" if seconds < 120 else f"checked {seconds // 60} min ago"


def cluster(now: datetime, seen: Access, window: Traffic | None) -> tuple[list[PoolRow], Any]:
    # `values()`: the pools' signing keys are never even loaded.
    pools = list(WorkerPool.objects.order_by("name").values("id", "name", "model", "protocol", "routing", "schedule_style"))
    endpoints = list(
        WorkerEndpoint.objects.order_by("pool_id", "role", "id").values(
            "id", "pool_id", "role", "url", "enabled", "draining", "healthy", "last_error", "last_checked_at", "capacity", "capacity_tokens",
        )
    )  # fmt: skip
    open_all = dict(
        Reservation.objects.filter(released_at__isnull=True, endpoint_id__isnull=False)
        .values_list("endpoint_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    here = local_state(e["id"] for e in endpoints)
    served = endpoint_traffic(window.since) if window is not None else {}
    by_pool: dict[int, list[EndpointRow]] = defaultdict(list)
    for e in endpoints:
        mine = here.endpoints[e["id"]]
        counts = served.get((e["role"], _url(e["url"])), (0, 0)) if window is not None else None
        by_pool[e["pool_id"]].append(EndpointRow(
            id=e["id"], role=e["role"], url=e["url"],
            change_url=reverse("admin:workers_workerendpoint_change", args=[e["id"]]) if seen.endpoints else None,
            state="disabled" if not e["enabled"] else "draining" if e["draining"] else "serving",
            healthy=e["healthy"], last_error=e["last_error"], checked=_ago(e["last_checked_at"], now),
            probed_here=mine.probed_healthy, breaker=mine.breaker, open_all=open_all.get(e["id"], 0),
            capacity=e["capacity"], capacity_tokens=e["capacity_tokens"], open_here=mine.open_here, tokens_here=mine.tokens_here,
            requests=counts[0] if counts is not None else None, failed=counts[1] if counts is not None else None,
            engine=mine.engine, engine_error=mine.engine_error, kv_events=mine.kv_events,
        ))  # fmt: skip
    rows = []
    for p in pools:
        of_pool = by_pool.get(p["id"], [])
        routable = {
            role: (
                sum(1 for e in of_pool if e.role == role and e.state == "serving" and e.healthy),
                sum(1 for e in of_pool if e.role == role),
            )
            for role in ROLES
        }
        figures = []
        if window is not None:
            tally = window.by_pool.get(p["name"], Tally())
            p50, p99 = tally.percentiles()
            figures = [
                ("requests / min", f"{window.rate(tally):,.1f}"),
                ("errors", f"{tally.error_count:,} ({share(tally.error_count, tally.requests)})"),
                ("first token p50", ms(p50)),
                ("p99", ms(p99)),
            ]
        rows.append(PoolRow(
            id=p["id"], name=p["name"], model=p["model"], protocol=p["protocol"], routing=p["routing"], schedule_style=p["schedule_style"],
            change_url=reverse("admin:workers_workerpool_change", args=[p["id"]]) if seen.pools else None,
            endpoints=of_pool, queued={role: here.queued_in(p["name"], role) for role in ROLES}, routable=routable, figures=figures,
        ))  # fmt: skip
    return rows, here


# --- the page -------------------------------------------------------------------------------------


def failed_requests(now: datetime, seen: Access) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        dict(row)
        for row in MessageRequest.objects.filter(status=RequestStatus.FAILED, received_at__gte=now - FAILED_LOOKBACK)
        .order_by("-received_at")
        .values(
            "id", "request_id", "received_at", "api_key_name", "model", "pool_name", "stage", "http_status", "error_type",
            "error_message", "context_endpoint", "generation_endpoint",
        )[:FAILED_SHOWN]
    ]  # fmt: skip
    for row in rows:
        row["url"] = reverse("admin:messages_api_messagerequest_change", args=[row["id"]]) if seen.audit_rows else None
        row["endpoint"] = row["generation_endpoint"] if row["stage"] == "generation" else row["context_endpoint"]
    return rows


def charts(window: Traffic) -> list[SafeString]:
    labels = [b.strftime("%H:%M") for b in window.buckets]
    minutes = [window.by_minute[b] for b in window.buckets]
    p50s, p99s = zip(*(t.percentiles() for t in minutes), strict=True) if minutes else ((), ())
    return [
        chart(
            f"Requests and errors per minute, last {WINDOW_MINUTES} minutes", labels,
            [Series("requests", BLUE, [float(t.requests) for t in minutes]), Series("errors", RED, [float(t.error_count) for t in minutes])],
            kind="overlaid bars",
        ),
        chart(
            f"Time to first token per minute, last {WINDOW_MINUTES} minutes", labels,
            [Series("p50", BLUE, [p or 0.0 for p in p50s], "ms"), Series("p99", ORANGE, [p or 0.0 for p in p99s], "ms")],
            kind="bars",  # a minute without a first token has no bar (a line would dip to 0)
        ),
    ]  # fmt: skip


def context(request: HttpRequest, now: datetime | None = None) -> dict[str, Any]:
    """Everything the page's live part shows, for the user's permissions."""
    now = now or datetime.now(timezone.utc)
    seen = access(request)
    window = traffic(now) if seen.traffic else None
    pools, here = cluster(now, seen, window) if seen.cluster else ([], None)
    alive = GatewayProcess.objects.filter(
        last_seen_at__gte=now - timedelta(seconds=settings.GATEWAY_DEAD_AFTER_S), recovered_at__isnull=True
    ).count()
    figures: list[tuple[str, str, str]] = []
    if window is not None:
        p50, p99 = window.total.percentiles()
        errors = window.total.error_count
        figures += [
            ("requests / min", f"{window.rate(window.total):,.1f}", f"{window.total.requests:,} in {WINDOW_MINUTES} min"),
            ("error rate", share(errors, window.total.requests), f"{errors:,} errors, {window.total.failed:,} failed"),
            ("first token p50", ms(p50), "sampled" if window.sampled else f"{len(window.total.ttft):,} requests"),
            ("first token p99", ms(p99), ""),
        ]
    if seen.cluster:
        in_flight = sum(e.open_all for p in pools for e in p.endpoints)
        queued = sum(n for p in pools for by_class in p.queued.values() for n in by_class.values())
        endpoints = [e for p in pools for e in p.endpoints]
        unhealthy = sum(1 for e in endpoints if e.state != "disabled" and not e.healthy)
        figures += [
            ("open reservations", f"{in_flight:,}", "every process"),
            ("queued here", f"{queued:,}", "this process"),
            ("unhealthy endpoints", f"{unhealthy} of {len(endpoints)}", ""),
        ]
    if seen.traffic:
        figures.append(batch_figure())
    figures.append(("gateway processes", f"{alive}", "alive (heartbeat)"))
    errors_by_type = []
    if window is not None:
        for error_type, by_status in sorted(window.error_statuses.items(), key=lambda item: (-sum(item[1].values()), item[0])):
            count = sum(by_status.values())
            errors_by_type.append({
                "type": error_type, "count": count, "share": share(count, window.total.requests),
                "failed": by_status.get(RequestStatus.FAILED, 0), "rejected": by_status.get(RequestStatus.REJECTED, 0),
            })  # fmt: skip
    return {
        "now": now,
        "seen": seen,
        "window_minutes": WINDOW_MINUTES,
        "figures": figures,
        "charts": charts(window) if window is not None else [],
        "pools": pools,
        "here": here,
        "priorities": PRIORITIES,
        "errors_by_type": errors_by_type,
        "failed": failed_requests(now, seen) if seen.traffic else [],
        "failed_lookback_h": int(FAILED_LOOKBACK.total_seconds() // 3600),
        "audit_url": reverse("admin:messages_api_messagerequest_changelist") if seen.audit_rows else None,
    }


def batch_figure() -> tuple[str, str, str]:
    """Message Batches in progress, and their items waiting and running (every process's: two
    small queries, the items' on their state index)."""
    batches = MessageBatch.objects.exclude(processing_status=BatchStatus.ENDED).count()
    items = dict(
        BatchItem.objects.filter(state__in=(ItemState.QUEUED, ItemState.RUNNING)).values_list("state").annotate(n=Count("id")).order_by()
    )
    return ("batches in progress", f"{batches:,}", f"{items.get(ItemState.QUEUED, 0):,} items waiting, {items.get(ItemState.RUNNING, 0):,} running")


def summary(request: HttpRequest, now: datetime | None = None) -> dict[str, Any]:
    """The admin index's strip: a few numbers and the link to the overview (three small queries)."""
    now = now or datetime.now(timezone.utc)
    seen = access(request)
    result: dict[str, Any] = {"seen": seen, "overview_url": reverse("admin:cluster_overview")}
    if seen.cluster:
        endpoints = list(WorkerEndpoint.objects.values_list("enabled", "draining", "healthy"))
        result["endpoints"] = len(endpoints)
        result["routable"] = sum(1 for enabled, draining, healthy in endpoints if enabled and not draining and healthy)
        result["pools"] = WorkerPool.objects.count()
    if seen.traffic:
        since = now - timedelta(minutes=WINDOW_MINUTES)
        counts = dict(
            MessageRequest.objects.filter(received_at__gte=since).values_list("status").annotate(n=Count("id")).order_by()
        )
        result["requests"] = sum(counts.values())
        result["failed"] = counts.get(RequestStatus.FAILED, 0)
    return result
