"""The audit row of one request, kept in memory while the request runs and written through the
background writer: once `in_progress` when the request is accepted, once more when it ends.

`end` is the only way to a terminal status and takes effect once, so every request ends in exactly
one terminal row whichever path ends it. A keyed request's usage goes with that row: the writer
adds it in the transaction that writes the terminal state (messages_api/usage.py), and the
recovery sweep counts the rows it closes in the transaction that closes them.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from django.conf import settings
from django.db import transaction

from disagg_project import GATEWAY_INSTANCE, get_writer
from messages_api import metrics, usage
from messages_api.models import MessageRequest, RequestStatus
from messages_api.request_context import loggable
from workers import Priority, RunProgress, SupportsProgress

access_log = logging.getLogger("messages_api.access")


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class AuditRecord:
    request_id: str = field(default_factory=new_request_id)
    received_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    received_monotonic: float = field(default_factory=time.monotonic)
    route: str = ""  # method and path, e.g. "POST /v1/messages"
    model: str = ""
    stream: bool = False
    status: str = RequestStatus.IN_PROGRESS
    stage: str = "received"
    http_status: int | None = None
    error_type: str = ""
    error_message: str = ""
    pool_name: str = ""
    context_endpoint: str = ""
    generation_endpoint: str = ""
    headers_sent_ms: float | None = None
    context_done_ms: float | None = None
    first_token_ms: float | None = None
    finished_ms: float | None = None
    queued_ms: float | None = None
    pings_sent: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    api_key_name: str = ""
    api_key_id: int | None = None  # the authenticated key's row (its name may change later)
    batch_id: str = ""  # a Message Batch item's attempt: its batch and custom_id
    custom_id: str = ""
    # The request's trace (32 hex digits) when it was sampled for tracing, else "" (disagg_project/telemetry.py).
    trace_id: str = ""
    # Read by the request's span only (messages_api/request_span.py); not in the row.
    max_tokens: int | None = None
    priority: Priority | None = None
    stop_reason: str = ""
    begun: bool = False
    ended: bool = False
    # The run serving the request, once there is one: its progress (stage, endpoints, timings) is
    # read whenever the row is written.
    run: SupportsProgress | None = None

    def received_earlier(self, seconds: float) -> None:
        """The server had the request `seconds` before this record was made."""
        if seconds > 0.0:
            self.received_monotonic -= seconds
            self.received_at -= timedelta(seconds=seconds)

    def since_received_ms(self, at: float | None = None) -> float:
        return round(((at if at is not None else time.monotonic()) - self.received_monotonic) * 1000.0, 3)

    def begin(self) -> None:
        """The request was accepted: make it visible as in progress."""
        self.begun = True
        self._write()

    def progress(self) -> None:
        """Make what is known so far (endpoints, timings) visible while the request runs."""
        if not self.ended:
            self._write()

    def end(
        self,
        status: str,
        *,
        http_status: int | None = None,
        error_type: str = "",
        error_message: str = "",
        persist: bool = True,
    ) -> bool:
        """Record the terminal status once; later calls change nothing and return False.

        With `persist=False` the request is counted in the metrics but leaves no row and no access
        log line (a sampled-out unauthenticated rejection).
        """
        if self.ended:
            return False
        self.ended = True
        self.status = status
        if http_status is not None:
            self.http_status = http_status
        self.error_type = error_type
        self.error_message = error_message[:2000]
        self.finished_ms = self.since_received_ms()
        if self.run is not None:
            self._read_progress(self.run.progress)  # the metrics' labels need the run's final stage
        metrics.observe(self)
        if not persist:
            if self.api_key_name:
                usage.note(self)
            return True
        self._write(counted=bool(self.api_key_name))
        # The model and the error's message may be the client's text: escaped, so that a newline or
        # a terminal escape in them cannot forge or hide a log line.
        access_log.info(
            "%s stream=%s status=%s http=%s stage=%s ms=%.1f%s",
            loggable(self.model) or "-", self.stream, status, self.http_status, self.stage, self.finished_ms,
            f" error={loggable(self.error_type)}: {loggable(self.error_message)}" if self.error_type else "",
            extra={"request_id": self.request_id},
        )
        return True

    def _write(self, *, counted: bool = False) -> None:
        """Queue the row's current state; `counted`: the terminal state of a keyed request, whose
        usage the writer adds in the same transaction."""
        if self.run is not None:
            self._read_progress(self.run.progress)
        get_writer().upsert(MessageRequest, "request_id", self.row(), along=self if counted else None)

    def _read_progress(self, progress: RunProgress) -> None:
        self.stage = progress.stage
        self.context_endpoint = progress.context_endpoint
        self.generation_endpoint = progress.generation_endpoint
        if progress.context_done_at is not None:
            self.context_done_ms = self.since_received_ms(progress.context_done_at)
        if progress.first_chunk_at is not None:
            self.first_token_ms = self.since_received_ms(progress.first_chunk_at)
        if progress.queued_s:
            self.queued_ms = progress.queued_s * 1000.0

    def row(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "received_at": self.received_at,
            "route": self.route[:200],
            "model": self.model[:200],
            "stream": self.stream,
            "status": self.status,
            "stage": self.stage,
            "http_status": self.http_status,
            "error_type": self.error_type,
            "error_message": self.error_message,
            "pool_name": self.pool_name,
            "context_endpoint": self.context_endpoint,
            "generation_endpoint": self.generation_endpoint,
            "headers_sent_ms": self.headers_sent_ms,
            "context_done_ms": self.context_done_ms,
            "first_token_ms": self.first_token_ms,
            "finished_ms": self.finished_ms,
            "queued_ms": self.queued_ms,
            "pings_sent": self.pings_sent,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "api_key_name": self.api_key_name,
            "api_key_id": self.api_key_id,
            "gateway_instance": GATEWAY_INSTANCE,
            "batch_id": self.batch_id,
            "custom_id": self.custom_id,
            "trace_id": self.trace_id,
        }


class RateSampler:
    """Lets at most `per_second` events through per second (a token bucket holding one second's
    worth), and counts the ones it held back so the next sample can say how many it stands for.

    Process-local and lock-free: it is only used from the event loop.
    """

    def __init__(self, per_second: float) -> None:
        self.per_second = per_second
        self._tokens = max(per_second, 1.0) if per_second > 0 else 0.0
        self._updated = time.monotonic()
        self.skipped = 0

    def take(self) -> int | None:
        """None when this event is not sampled; else how many were skipped since the last sample."""
        if self.per_second <= 0:
            self.skipped += 1
            return None
        now = time.monotonic()
        self._tokens = min(max(self.per_second, 1.0), self._tokens + (now - self._updated) * self.per_second)
        self._updated = now
        if self._tokens < 1.0:
            self.skipped += 1
            return None
        self._tokens -= 1.0
        skipped, self.skipped = self.skipped, 0
        return skipped


_unauthenticated_sampler: RateSampler | None = None


def sample_unauthenticated() -> int | None:
    """Whether to write this unauthenticated rejection's row (AUDIT_UNAUTHENTICATED_SAMPLE_PER_S):
    None if not, else how many such rejections went unrecorded since the last written one."""
    global _unauthenticated_sampler
    if _unauthenticated_sampler is None:
        _unauthenticated_sampler = RateSampler(settings.AUDIT_UNAUTHENTICATED_SAMPLE_PER_S)
    return _unauthenticated_sampler.take()


def sample_anonymous(detail: str) -> str | None:
    """Count a request refused without a valid API key (gateway_unauthenticated_rejections_total),
    wherever it was refused; the error message its audit row gets if it is sampled, else None."""
    metrics.unauthenticated_rejections.inc()
    skipped = sample_unauthenticated()
    if skipped is None:
        return None
    return detail + (f" (and {skipped} more unauthenticated rejections not recorded since the last)" if skipped else "")


_refused_samplers: dict[str, RateSampler] = {}


def sample_refused(key_name: str, detail: str) -> str | None:
    """Whether to write the row of a known key's request refused before it was accepted (a 429, a
    400, a 529 shed): at most AUDIT_REFUSED_SAMPLE_PER_S a second per key and process, so that a
    key over its limits — which can send refusals as fast as the network allows — cannot fill the
    database, or spend the gateway's time writing rows (tenants.py's limited flood: ~15 % of the
    gateway's CPU was those rows). The metrics and the key's usage count every refusal. The error
    message the row gets if it is sampled, else None."""
    sampler = _refused_samplers.get(key_name)
    if sampler is None:
        sampler = _refused_samplers[key_name] = RateSampler(settings.AUDIT_REFUSED_SAMPLE_PER_S)
    skipped = sampler.take()
    if skipped is None:
        return None
    return detail + (f" (and {skipped} more refusals of this key not recorded since the last)" if skipped else "")


# Rows closed per statement (well under SQLite's and PostgreSQL's parameter limits).
_CLOSED_PER_QUERY = 500


def close_abandoned_requests(sender: object, instances: list[str], reason: str, **kwargs: Any) -> None:
    """`workers.cluster.recovery.process_abandoned` receiver: a dead process's requests end `failed`,
    and count in their keys' usage, in one transaction (the rows locked while it runs: two sweeps
    at once count each row once, PostgreSQL's row locks and SQLite's IMMEDIATE transactions alike)."""
    with transaction.atomic():
        rows = list(
            MessageRequest.objects.select_for_update()
            .filter(gateway_instance__in=instances, status=RequestStatus.IN_PROGRESS)
            .order_by("pk")
            .values("pk", *usage.ABANDONED_FIELDS)
        )
        if not rows:
            return
        for start in range(0, len(rows), _CLOSED_PER_QUERY):
            MessageRequest.objects.filter(pk__in=[row["pk"] for row in rows[start : start + _CLOSED_PER_QUERY]]).update(
                status=RequestStatus.FAILED, error_type="api_error", error_message=reason
            )
        usage.count_abandoned(rows, "api_error")
