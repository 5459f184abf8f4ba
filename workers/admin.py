"""The cluster in the admin: pools with their endpoints inline (one line each), endpoints (their
protocol options on their own page), reservations, the model catalogue.

Every admin here is a `GuardedAdmin`: a model's secrets (a pool's handoff signing key) are never
rendered as a value, and no changelist filters on them.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from django import forms
from django.contrib import admin
from django.db.models import Count, Q, QuerySet, URLField
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from disagg_project import GuardedAdmin, ReadOnlyAdmin
from workers.models import ModelRoute, ModelRoutePool, Reservation, WorkerEndpoint, WorkerPool

# --- endpoints ------------------------------------------------------------------------------------


def with_open_reservations(queryset: QuerySet[WorkerEndpoint]) -> QuerySet[WorkerEndpoint]:
    """Endpoints annotated with their open reservations (one query for a whole page)."""
    return queryset.annotate(open_reservation_count=Count("reservations", filter=Q(reservations__released_at__isnull=True)))


@admin.display(description="open reservations")
def open_reservations(endpoint: WorkerEndpoint) -> int:
    """Reservations held on the endpoint now, by every gateway process (as last written)."""
    counted = getattr(endpoint, "open_reservation_count", None)
    if counted is not None:
        return int(counted)
    # The empty row of the admin's "add another" form is unsaved: django-stubs types the primary
    # key as the field's `int`, but it is None until the row is saved.
    pk = cast("int | None", endpoint.pk)
    if pk is None:
        return 0
    return endpoint.reservations.filter(released_at__isnull=True).count()


def _ago(when: datetime | None) -> str:
    if when is None:
        return "never"
    seconds = max(0, int((datetime.now(timezone.utc) - when).total_seconds()))
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 7200:
        return f"{seconds // 60} min ago"
    return f"{seconds // 3600} h ago" if seconds < 172800 else f"{seconds // 86400} d ago"


@admin.display(description="health")
def health(endpoint: WorkerEndpoint) -> SafeString:
    """Healthy or not as the probes last wrote it (every gateway process probes), when, and the
    last probe error, on one line (the full error in its title)."""
    if cast("int | None", endpoint.pk) is None:
        return format_html("{}", "—")
    checked = f"checked {_ago(endpoint.last_checked_at)}"
    if endpoint.healthy:
        return format_html('<span class="gw-health gw-ok" title="{}">✓ healthy</span>', checked)
    return format_html(
        '<span class="gw-health gw-bad" title="{}">✗ {}</span>', f"{checked}: {endpoint.last_error}", endpoint.last_error or "unhealthy"
    )


@admin.display(description="options")
def options_link(endpoint: WorkerEndpoint) -> SafeString:
    """The endpoint's protocol options, short, linking to its own page where they are edited."""
    if cast("int | None", endpoint.pk) is None:
        return format_html("{}", "—")
    url = reverse("admin:workers_workerendpoint_change", args=[endpoint.pk])
    summary = ", ".join(f"{k}={v}" for k, v in (endpoint.options or {}).items()) or "none"
    return format_html('<a class="gw-options" href="{}" title="{}">{}</a>', url, f"Edit the options: {summary}", summary)


class EndpointInlineForm(forms.ModelForm[WorkerEndpoint]):
    # A plain input: the admin's URL widget adds a "Currently: <link> / Change:" block to every
    # saved row, which made each endpoint two lines tall. Workers speak plain HTTP: a URL typed
    # without a scheme is http://.
    url = forms.URLField(
        max_length=300, assume_scheme="http", widget=forms.URLInput(attrs={"class": "gw-url", "size": 30}),
        help_text=WorkerEndpoint._meta.get_field("url").help_text,
    )  # fmt: skip

    class Meta:
        model = WorkerEndpoint
        fields = ("role", "url", "enabled", "draining", "capacity", "capacity_tokens")
        widgets = {
            "capacity": forms.NumberInput(attrs={"class": "gw-number", "min": 0}),
            "capacity_tokens": forms.NumberInput(attrs={"class": "gw-number gw-number-wide", "min": 0}),
        }


# Django's admin takes a callable wherever it takes a read-only field's name (`fields`,
# `readonly_fields`) and a callable returning any value in `list_display`; django-stubs allows
# only names there, and only callables returning str or bool. Hence the ignores on those.
class WorkerEndpointInline(admin.TabularInline[WorkerEndpoint, WorkerPool]):
    model = WorkerEndpoint
    form = EndpointInlineForm
    extra = 0
    # One line per endpoint: its protocol options (a JSON box) are edited on the endpoint's own page.
    fields = (  # type: ignore[assignment]
        "role", "url", "enabled", "draining", "capacity", "capacity_tokens", health, open_reservations, options_link,
    )
    readonly_fields = (health, open_reservations, options_link)  # type: ignore[assignment]
    classes = ("gw-endpoints",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerEndpoint]:
        return with_open_reservations(super().get_queryset(request))


class WorkerPoolForm(forms.ModelForm[WorkerPool]):
    """The pool, with its handoff signing key write-only: the form never renders the stored key
    (not even masked in the page source), a blank field keeps it, and only the explicit "clear"
    box removes it."""

    handoff_signing_key = forms.CharField(
        required=False,
        strip=True,
        max_length=256,
        label="Handoff signing key",
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="The shared secret the pool's workers verify signed handoffs with (TensorRT-LLM's "
        "internal_request_auth_key). Write-only: leave blank to keep the current key.",
    )
    clear_handoff_signing_key = forms.BooleanField(
        required=False, label="Clear the handoff signing key", help_text="Remove the key (the handoffs go unsigned)."
    )

    class Meta:
        model = WorkerPool
        fields = ("name", "model", "protocol", "schedule_style", "routing", "max_local_prefill_tokens", "cache_scope", "handoff_signing_key")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Whatever the model holds, the field starts empty: the key never reaches the page.
        self.initial["handoff_signing_key"] = ""

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if cleaned.get("clear_handoff_signing_key") and cleaned.get("handoff_signing_key"):
            self.add_error("clear_handoff_signing_key", "Either set a new key or clear it, not both.")
        return cleaned

    def save(self, commit: bool = True) -> WorkerPool:
        pool = super().save(commit=False)
        stored = "" if pool.pk is None else WorkerPool.objects.filter(pk=pool.pk).values_list("handoff_signing_key", flat=True).first() or ""
        if self.cleaned_data.get("clear_handoff_signing_key"):
            pool.handoff_signing_key = ""
        elif not self.cleaned_data.get("handoff_signing_key"):
            pool.handoff_signing_key = stored
        if commit:
            pool.save()
            self.save_m2m()
        return pool


CLUSTER_CSS = {"all": ("workers/admin/cluster.css",)}


@admin.register(WorkerPool)
class WorkerPoolAdmin(GuardedAdmin[WorkerPool]):
    form = WorkerPoolForm
    secret_fields = ("handoff_signing_key",)
    edit_only_fields = ("clear_handoff_signing_key",)
    list_display = (
        "name", "model", "protocol", "schedule_style", "routing", "max_local_prefill_tokens", "cache_scope", "signing_key_set",
        "endpoint_summary",
    )
    list_filter = ("protocol", "schedule_style", "routing", "cache_scope")
    search_fields = ("name", "model")
    fieldsets = (
        (None, {"fields": (("name", "model"), ("protocol", "schedule_style"), ("routing", "max_local_prefill_tokens"), "cache_scope")}),
        ("Handoff signing key", {"fields": ("signing_key_set", "handoff_signing_key", "clear_handoff_signing_key")}),
    )
    readonly_fields = ("signing_key_set",)
    inlines = [WorkerEndpointInline]

    class Media:
        css = CLUSTER_CSS

    @admin.display(description="signing key set", boolean=True)
    def signing_key_set(self, pool: WorkerPool) -> bool:
        return bool(pool.handoff_signing_key)

    @admin.display(description="endpoints")
    def endpoint_summary(self, pool: WorkerPool) -> str:
        endpoints = list(pool.endpoints.all())
        parts = []
        for role in ("context", "generation"):
            of_role = [e for e in endpoints if e.role == role]
            routable = [e for e in of_role if e.enabled and not e.draining and e.healthy]
            parts.append(f"{role}: {len(routable)}/{len(of_role)} routable")
        return "; ".join(parts)

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerPool]:
        return super().get_queryset(request).prefetch_related("endpoints")


@admin.register(WorkerEndpoint)
class WorkerEndpointAdmin(GuardedAdmin[WorkerEndpoint]):
    list_display = (  # type: ignore[assignment]
        "url", "pool_name", "role", "enabled", "draining", "capacity", "capacity_tokens", health, open_reservations,
    )
    list_filter = ("pool", "role", "enabled", "draining", "healthy")
    search_fields = ("url", "pool__name")
    fieldsets = (
        (None, {"fields": ("pool", "role", "url")}),
        ("Routing", {"fields": (("enabled", "draining"), ("capacity", "capacity_tokens"))}),
        ("Protocol options", {"fields": ("options",)}),
        (
            "KV-cache events",
            {
                "fields": (
                    ("kv_events_address", "kv_events_replay_address"), "kv_events_topic", ("kv_block_size", "kv_hash_algorithm", "kv_hash_seed"),
                )
            },
        ),
        (
            "Health (as the probes last wrote it)",
            {"fields": (("healthy", "consecutive_failures"), "last_checked_at", "last_error", open_reservations, ("created_at", "updated_at"))},  # type: ignore[typeddict-item]
        ),
    )
    readonly_fields = (  # type: ignore[assignment]
        "healthy", "consecutive_failures", "last_checked_at", "last_error", open_reservations, "created_at", "updated_at",
    )
    actions = ["drain", "enable", "disable"]
    list_select_related = ("pool",)
    # As in the pool page's inline (EndpointInlineForm): workers speak plain HTTP, so a URL typed
    # without a scheme is http:// (Django 6 would make it https://, and warns until then).
    formfield_overrides = {URLField: {"assume_scheme": "http"}}

    class Media:
        css = CLUSTER_CSS

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerEndpoint]:
        return with_open_reservations(super().get_queryset(request))

    @admin.display(description="pool", ordering="pool__name")
    def pool_name(self, endpoint: WorkerEndpoint) -> str:
        return endpoint.pool.name

    @admin.action(description="Drain: finish in-flight requests, take no new ones")
    def drain(self, request: HttpRequest, queryset: QuerySet[WorkerEndpoint]) -> None:
        self._apply(request, queryset, {"draining": True}, "Drained (admin action)")
        self.message_user(request, f"{len(queryset)} endpoint(s) draining: in-flight requests finish, no new ones arrive (within ~2 s).")

    @admin.action(description="Enable (and stop draining)")
    def enable(self, request: HttpRequest, queryset: QuerySet[WorkerEndpoint]) -> None:
        self._apply(request, queryset, {"enabled": True, "draining": False}, "Enabled (admin action)")
        self.message_user(request, f"{len(queryset)} endpoint(s) enabled.")

    @admin.action(description="Disable")
    def disable(self, request: HttpRequest, queryset: QuerySet[WorkerEndpoint]) -> None:
        self._apply(request, queryset, {"enabled": False}, "Disabled (admin action)")
        self.message_user(request, f"{len(queryset)} endpoint(s) disabled: no new requests (within ~2 s).")

    def _apply(self, request: HttpRequest, queryset: QuerySet[WorkerEndpoint], values: dict[str, bool], message: str) -> None:
        """Set `values` on each endpoint and record who did it in the admin's history, as a change
        through the form would be."""
        for endpoint in queryset:  # save() per row so updated_at moves and every process reloads
            for field_name, value in values.items():
                setattr(endpoint, field_name, value)
            endpoint.save(update_fields=[*values, "updated_at"])
            self.log_change(request, endpoint, message)


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin[Reservation]):
    list_display = ("request_id", "pool_name", "stage", "endpoint_url", "reserved_at", "released_at", "outcome")
    list_filter = ("outcome", "stage", "pool_name", ("released_at", admin.EmptyFieldListFilter), "reserved_at")
    search_fields = ("request_id", "endpoint_url")
    date_hierarchy = "reserved_at"


class ModelRoutePoolInline(admin.TabularInline[ModelRoutePool, ModelRoute]):
    model = ModelRoutePool
    extra = 1
    fields = ("position", "pool")
    ordering = ("position",)
    classes = ("gw-route-pools",)


@admin.register(ModelRoute)
class ModelRouteAdmin(GuardedAdmin[ModelRoute]):
    """The model catalogue: public names (exact or patterns) and the pools serving each, in order."""

    list_display = ("name", "kind", "display_name", "pools_in_order", "upstream_model", "updated_at")
    search_fields = ("name", "display_name", "upstream_model")
    fields = ("name", "display_name", "upstream_model")
    inlines = [ModelRoutePoolInline]

    class Media:
        css = CLUSTER_CSS

    def get_queryset(self, request: HttpRequest) -> QuerySet[ModelRoute]:
        return super().get_queryset(request).prefetch_related("route_pools__pool")

    @admin.display(description="kind")
    def kind(self, route: ModelRoute) -> str:
        return "pattern" if route.is_pattern else "exact"

    @admin.display(description="pools (first preferred)")
    def pools_in_order(self, route: ModelRoute) -> SafeString:
        places = sorted(route.route_pools.all(), key=lambda place: (place.position, place.id))
        if not places:
            return format_html("{}", "—")
        return format_html_join(
            " › ", '<a href="{}">{}</a>',
            ((reverse("admin:workers_workerpool_change", args=[place.pool_id]), place.pool.name) for place in places),
        )  # fmt: skip
