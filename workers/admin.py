from __future__ import annotations

from typing import TypeVar, cast

from django.contrib import admin
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from workers.models import Reservation, WorkerEndpoint, WorkerPool

_M = TypeVar("_M", bound=Model)


@admin.display(description="open reservations")
def open_reservations(endpoint: WorkerEndpoint) -> int:
    """Reservations held on the endpoint now, by every gateway process (as last written)."""
    # The empty row of the admin's "add another" form is unsaved: django-stubs types the primary
    # key as the field's `int`, but it is None until the row is saved.
    pk = cast("int | None", endpoint.pk)
    if pk is None:
        return 0
    return endpoint.reservations.filter(released_at__isnull=True).count()


# Django's admin takes a callable wherever it takes a read-only field's name (`fields`,
# `readonly_fields`) and a callable returning any value in `list_display`; django-stubs allows
# only names there, and only callables returning str or bool. Hence the ignores on those three.
class WorkerEndpointInline(admin.TabularInline[WorkerEndpoint, WorkerPool]):
    model = WorkerEndpoint
    extra = 0
    fields = (  # type: ignore[assignment]
        "role", "url", "options", "enabled", "draining", "healthy", open_reservations,
        "consecutive_failures", "last_checked_at", "last_error",
    )
    readonly_fields = ("healthy", open_reservations, "consecutive_failures", "last_checked_at", "last_error")  # type: ignore[assignment]


@admin.register(WorkerPool)
class WorkerPoolAdmin(admin.ModelAdmin[WorkerPool]):
    list_display = ("name", "model", "protocol", "schedule_style", "routing", "max_local_prefill_tokens", "endpoint_summary")
    list_filter = ("protocol", "schedule_style", "routing")
    search_fields = ("name", "model")
    fields = ("name", "model", "protocol", "schedule_style", "routing", "max_local_prefill_tokens")
    inlines = [WorkerEndpointInline]

    @admin.display(description="endpoints")
    def endpoint_summary(self, pool: WorkerPool) -> str:
        endpoints = list(pool.endpoints.all())
        parts = []
        for role in ("context", "generation"):
            of_role = [e for e in endpoints if e.role == role]
            routable = [e for e in of_role if e.enabled and not e.draining and e.healthy]
            parts.append(f"{role}: {len(routable)}/{len(of_role)} routable")
        return "; ".join(parts)


@admin.register(WorkerEndpoint)
class WorkerEndpointAdmin(admin.ModelAdmin[WorkerEndpoint]):
    list_display = (  # type: ignore[assignment]
        "url", "pool", "role", "enabled", "draining", "healthy", open_reservations, "last_checked_at", "last_error",
    )
    list_filter = ("pool", "role", "enabled", "draining", "healthy")
    search_fields = ("url", "pool__name")
    readonly_fields = ("healthy", "consecutive_failures", "last_checked_at", "last_error", "created_at", "updated_at")
    actions = ["drain", "enable", "disable"]

    @admin.action(description="Drain: finish in-flight requests, take no new ones")
    def drain(self, request: HttpRequest, queryset: QuerySet[WorkerEndpoint]) -> None:
        for endpoint in queryset:  # save() per row so updated_at moves and every process reloads
            endpoint.draining = True
            endpoint.save(update_fields=["draining", "updated_at"])
        self.message_user(request, f"{len(queryset)} endpoint(s) draining: in-flight requests finish, no new ones arrive (within ~2 s).")

    @admin.action(description="Enable (and stop draining)")
    def enable(self, request: HttpRequest, queryset: QuerySet[WorkerEndpoint]) -> None:
        for endpoint in queryset:
            endpoint.enabled, endpoint.draining = True, False
            endpoint.save(update_fields=["enabled", "draining", "updated_at"])
        self.message_user(request, f"{len(queryset)} endpoint(s) enabled.")

    @admin.action(description="Disable")
    def disable(self, request: HttpRequest, queryset: QuerySet[WorkerEndpoint]) -> None:
        for endpoint in queryset:
            endpoint.enabled = False
            endpoint.save(update_fields=["enabled", "updated_at"])
        self.message_user(request, f"{len(queryset)} endpoint(s) disabled: no new requests (within ~2 s).")


class ReadOnlyAdmin(admin.ModelAdmin[_M]):
    """Rows written by the gateway: operators read them, never edit them."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin[Reservation]):
    list_display = ("request_id", "pool_name", "stage", "endpoint_url", "reserved_at", "released_at", "outcome")
    list_filter = ("outcome", "stage", "pool_name", ("released_at", admin.EmptyFieldListFilter), "reserved_at")
    search_fields = ("request_id", "endpoint_url")
    date_hierarchy = "reserved_at"
