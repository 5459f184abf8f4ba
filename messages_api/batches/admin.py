"""Message Batches in the admin: one line per batch (owner, progress by state, age, expiry), each
linked to its items' audit rows, and a cancel action (imported by messages_api/admin.py, which
Django's autodiscovery reads)."""

from __future__ import annotations

from datetime import datetime, timezone

from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from disagg_project import ReadOnlyAdmin
from messages_api.batches import store
from messages_api.models import BatchStatus, MessageBatch, ResultType

# The progress column's parts, in order: (label, CSS class of the console's badges).
PROGRESS = (
    ("queued", ""),
    ("running", "gw-warn"),
    ("succeeded", "gw-ok"),
    ("errored", "gw-bad"),
    ("canceled", ""),
    ("expired", "gw-bad"),
)


def _age(moment: datetime) -> str:
    seconds = max(0, int((datetime.now(timezone.utc) - moment).total_seconds()))
    if seconds < 3600:
        return f"{seconds // 60} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


@admin.register(MessageBatch)
class MessageBatchAdmin(ReadOnlyAdmin[MessageBatch]):
    list_display = ("batch_id", "owner", "processing_status", "progress", "age", "expires", "audit")
    list_filter = ("processing_status", "created_at")
    search_fields = ("batch_id", "api_key_name")
    date_hierarchy = "created_at"
    list_per_page = 50
    actions = ("cancel_batches",)
    readonly_fields = ("progress", "audit", "owner")
    fields = (
        "batch_id", "owner", "processing_status", "progress", "audit", "created_at", "expires_at", "ended_at",
        "cancel_initiated_at", "archived_at", "total",
    )

    class Media:
        css = {"all": ("messages_api/admin/console.css",)}

    def get_queryset(self, request: HttpRequest) -> QuerySet[MessageBatch]:
        # Each batch's items by state or result, counted in the page's one query.
        counts = {f"n_{state}": Count("items", filter=Q(items__state=state)) for state in ("queued", "running")}
        counts |= {f"n_{result}": Count("items", filter=Q(items__result_type=result)) for result in ResultType.values}
        return super().get_queryset(request).annotate(**counts)

    @admin.display(description="owner", ordering="api_key_name")
    def owner(self, batch: MessageBatch) -> SafeString:
        return format_html('<a href="{}">{}</a>', reverse("admin:messages_api_apikey_change", args=[batch.api_key_id]), batch.api_key_name)

    @admin.display(description="progress (items by state)")
    def progress(self, batch: MessageBatch) -> SafeString:
        counts = {label: getattr(batch, f"n_{label}", 0) for label, _ in PROGRESS}
        if not any(counts.values()) and batch.processing_status == BatchStatus.ENDED:  # archived: its items are gone
            counts = {"succeeded": batch.succeeded, "errored": batch.errored, "canceled": batch.canceled, "expired": batch.expired}
        parts = [(css, label, counts[label]) for label, css in PROGRESS if counts.get(label)]
        if not parts:
            return format_html("{}", f"0 of {batch.total}")
        return format_html_join(" ", '<span class="{}">{} {}</span>', parts)

    @admin.display(description="age", ordering="created_at")
    def age(self, batch: MessageBatch) -> str:
        return _age(batch.created_at)

    @admin.display(description="expires (UTC)", ordering="expires_at")
    def expires(self, batch: MessageBatch) -> str:
        return batch.expires_at.strftime("%Y-%m-%d %H:%M")

    @admin.display(description="items' requests")
    def audit(self, batch: MessageBatch) -> SafeString:
        url = reverse("admin:messages_api_messagerequest_changelist") + f"?batch_id={batch.batch_id}"
        return format_html('<a href="{}">audit rows</a>', url)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("messages_api.change_messagebatch")

    @admin.action(description="Cancel the selected batches", permissions=["cancel"])
    def cancel_batches(self, request: HttpRequest, queryset: QuerySet[MessageBatch]) -> None:
        canceled = 0
        for batch in queryset.exclude(processing_status=BatchStatus.ENDED):
            if store.cancel_batch(batch.api_key_id, batch.batch_id) is not None:
                canceled += 1
        self.message_user(request, f"Cancellation started for {canceled} batch(es).", messages.SUCCESS)
