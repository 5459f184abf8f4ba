"""The front door in the admin: API keys (their hash never shown) and the request audit, whose list
fits a 1440 px screen one line per request and whose detail page is laid out for reading a failure:
the timeline, the error as the client got it and as recorded, the endpoints and reservations."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from disagg_project import GuardedAdmin, ReadOnlyAdmin
from messages_api.auth import KEY_PREFIX, generate_key, hash_key
from messages_api.models import ApiKey, MessageRequest, RequestStatus
from messages_api.usage_report import KeyUsagePages
from workers.models import Reservation, WorkerEndpoint, WorkerPool

CONSOLE_CSS = {"all": ("messages_api/admin/console.css",)}
FAILED_HERE = mark_safe(' <strong class="gw-bad">failed here</strong>')


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 10 else f"{value:,.1f}"


# The points of a request's life, in order: (label, field), each milliseconds after receipt.
TIMELINE = (
    ("headers sent", "headers_sent_ms"),
    ("context done", "context_done_ms"),
    ("first token", "first_token_ms"),
    ("finished", "finished_ms"),
)


@admin.register(MessageRequest)
class MessageRequestAdmin(ReadOnlyAdmin[MessageRequest]):
    list_display = (
        "request_link", "received", "key", "model_name", "status_badge", "stage", "http", "error", "ttft", "total",
    )
    list_filter = (
        "status", "stage", "stream", "error_type", "pool_name", "context_endpoint", "generation_endpoint", "received_at",
    )
    search_fields = ("request_id", "error_message", "model")
    date_hierarchy = "received_at"
    list_per_page = 50
    readonly_fields = (
        "summary", "timeline", "client_error", "endpoints", "reservations", "key_link", "trace",
    )

    class Media:
        css = CONSOLE_CSS

    # --- the list: one line per request ----------------------------------------------------------

    @admin.display(description="request", ordering="request_id")
    def request_link(self, row: MessageRequest) -> SafeString:
        # The whole id is in the cell (search and copy find it); the column cuts it on screen.
        return format_html('<span class="gw-mono" title="{}">{}</span>', row.request_id, row.request_id)

    @admin.display(description="received (UTC)", ordering="received_at")
    def received(self, row: MessageRequest) -> SafeString:
        return format_html('<span title="{}">{}</span>', row.received_at.isoformat(), row.received_at.strftime("%m-%d %H:%M:%S"))

    @admin.display(description="key", ordering="api_key_name")
    def key(self, row: MessageRequest) -> SafeString:
        return format_html('<span title="{}">{}</span>', row.api_key_name, row.api_key_name or "—")

    @admin.display(description="model", ordering="model")
    def model_name(self, row: MessageRequest) -> SafeString:
        return format_html('<span title="{}">{}</span>', row.model, row.model or "—")

    @admin.display(description="status", ordering="status")
    def status_badge(self, row: MessageRequest) -> SafeString:
        return format_html('<span class="gw-status-{}">{}</span>', row.status, row.get_status_display())

    @admin.display(description="HTTP", ordering="http_status")
    def http(self, row: MessageRequest) -> str:
        return "—" if row.http_status is None else str(row.http_status)

    @admin.display(description="error", ordering="error_type", empty_value="")
    def error(self, row: MessageRequest) -> SafeString:
        """The type and the start of the message on one line (the whole on the detail page)."""
        if not row.error_type and not row.error_message:
            return format_html("{}", "")
        message = row.error_message if len(row.error_message) <= 300 else row.error_message[:299] + "…"
        return format_html('<span title="{}"><code>{}</code> {}</span>', message, row.error_type, message)

    @admin.display(description="TTFT ms", ordering="first_token_ms")
    def ttft(self, row: MessageRequest) -> str:
        return _ms(row.first_token_ms)

    @admin.display(description="total ms", ordering="finished_ms")
    def total(self, row: MessageRequest) -> str:
        return _ms(row.finished_ms)

    # --- the detail page ----------------------------------------------------------------------------

    def get_fieldsets(self, request: HttpRequest, obj: MessageRequest | None = None) -> Any:
        fieldsets: list[tuple[str | None, dict[str, Any]]] = [
            (None, {"fields": ("request_id", "status", "summary", "key_link", "trace")}),
            ("Timeline (ms after receipt)", {"fields": ("timeline",)}),
        ]
        if obj is not None and (obj.error_type or obj.error_message):
            fieldsets.append((
                "The error",
                {
                    "fields": ("client_error", "error_message"),
                    "description": "What the client was answered, then the text the audit keeps: the worker's own "
                    "words when a worker sent them (secrets masked), else what the client was told.",
                },
            ))  # fmt: skip
        fieldsets += [
            ("Endpoints", {"fields": ("endpoints", "reservations")}),
            ("Usage", {"fields": (("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"), "pings_sent")}),
            (
                "Every field",
                {
                    "classes": ("collapse",),
                    "fields": (
                        ("received_at", "route"), ("model", "stream"), ("api_key_name", "gateway_instance"), ("batch_id", "custom_id"),
                        ("stage", "http_status", "error_type"), ("pool_name",), ("context_endpoint", "generation_endpoint"),
                        ("headers_sent_ms", "queued_ms", "context_done_ms"), ("first_token_ms", "finished_ms"),
                    ),
                },
            ),
        ]  # fmt: skip
        return fieldsets

    @admin.display(description="trace")
    def trace(self, row: MessageRequest) -> SafeString:
        """The request's OpenTelemetry trace id, a link to it through TRACE_URL_TEMPLATE when set."""
        if not row.trace_id:
            return format_html("{}", "— (not traced)")
        template: str = settings.TRACE_URL_TEMPLATE
        if not template:
            return format_html('<span class="gw-mono">{}</span>', row.trace_id)
        url = template.replace("{trace_id}", row.trace_id)
        return format_html('<a class="gw-mono" href="{}" rel="noopener noreferrer" target="_blank">{}</a>', url, row.trace_id)

    @admin.display(description="outcome")
    def summary(self, row: MessageRequest) -> SafeString:
        parts = [
            ("HTTP", str(row.http_status or "—")),
            ("stage", row.stage or "—"),
            ("received", row.received_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"),
            ("route", row.route or "—"),
            ("model", row.model or "—"),
            ("stream", "yes" if row.stream else "no"),
            ("pool", row.pool_name or "—"),
            ("gateway process", row.gateway_instance or "—"),
        ]
        return format_html('<dl class="gw-kv">{}</dl>', format_html_join("", "<dt>{}</dt><dd>{}</dd>", parts))

    @admin.display(description="API key")
    def key_link(self, row: MessageRequest) -> SafeString:
        if not row.api_key_name:
            return format_html("{}", "— (no valid key)")
        key = ApiKey.objects.filter(name=row.api_key_name).values_list("pk", flat=True).first()
        if key is None:
            return format_html("{} (deleted)", row.api_key_name)
        return format_html('<a href="{}">{}</a>', reverse("admin:messages_api_apikey_change", args=[key]), row.api_key_name)

    @admin.display(description="timeline")
    def timeline(self, row: MessageRequest) -> SafeString:
        """Each point of the request's life as a bar from receipt, the time queued for a slot
        (one total: a request may wait before each stage) as its own bar, missing points named."""
        end = max([v for _, f in TIMELINE if (v := getattr(row, f)) is not None] + [row.queued_ms or 0.0, 1e-9])
        failed = row.status == RequestStatus.FAILED
        lines: list[SafeString] = [self._line("received", 0.0, None, end, "")]
        previous = 0.0
        if row.queued_ms:
            lines.append(self._line("queued (in total)", row.queued_ms, None, end, "gw-queued", duration=True))
        for label, name in TIMELINE:
            at: float | None = getattr(row, name)
            if at is None:
                lines.append(format_html(
                    '<tr class="gw-missing"><th>{}</th><td class="gw-at">—</td><td class="gw-delta"></td><td>{}</td></tr>',
                    label, self._why_missing(row, name),
                ))  # fmt: skip
                continue
            css = "gw-end-failed" if name == "finished_ms" and failed else ""
            lines.append(self._line(label, at, at - previous, end, css))
            previous = at
        return format_html(
            '<table class="gw-timeline"><colgroup><col class="gw-c-label"><col class="gw-c-ms"><col class="gw-c-ms"><col></colgroup>'
            '<thead><tr><th></th><th class="gw-num">ms</th><th class="gw-num">+ms</th><th></th></tr></thead>'
            "<tbody>{}</tbody></table>",
            format_html_join("", "{}", ((line,) for line in lines)),
        )

    @staticmethod
    def _line(label: str, at: float, delta: float | None, end: float, css: str, *, duration: bool = False) -> SafeString:
        width = f"{min(100.0, 100.0 * at / end):.2f}%"
        return format_html(
            '<tr><th>{}</th><td class="gw-at">{}</td><td class="gw-delta">{}</td>'
            '<td><div class="gw-bar"><span class="{}" style="width: {}" title="{} ms"></span></div></td></tr>',
            label, f"{at:,.1f}" if not duration else f"{at:,.1f} long", "" if delta is None else f"+{delta:,.1f}",
            css, width, f"{at:,.1f}",
        )  # fmt: skip

    @staticmethod
    def _why_missing(row: MessageRequest, name: str) -> str:
        if name == "headers_sent_ms":
            return "not streamed" if not row.stream else "never: answered before the stream started"
        if name == "context_done_ms":
            if row.stage == "context":
                return f"never: ended in the context stage ({row.get_status_display()})"
            return "no context phase (aggregated, or a short prompt served locally)" if row.first_token_ms is not None else "never"
        if name == "first_token_ms":
            return f"never: ended in the {row.stage or 'received'} stage ({row.get_status_display()})"
        return "not finished" if row.status == RequestStatus.IN_PROGRESS else "never"

    @admin.display(description="as the client got it")
    def client_error(self, row: MessageRequest) -> SafeString:
        """How the error reached the client. Its message is not stored apart: for a worker's error
        the client got a scrubbed version of the text below (no addresses, paths or secrets)."""
        if row.stream and row.headers_sent_ms is not None and row.http_status == 200:
            how = format_html(
                "as an <code>error</code> event in the stream, after its <code>200</code> status line (sent at {} ms)", _ms(row.headers_sent_ms)
            )
        else:
            how = format_html("as the HTTP answer: status <code>{}</code>", row.http_status or "—")
        envelope = '{"type": "error", "error": {"type": "%s", "message": "…"}, "request_id": "%s"}' % (row.error_type, row.request_id)
        return format_html(
            '{}<pre class="gw-errorbox">{}</pre><p class="gw-note">The message is not stored apart: for a worker\'s error the client got '
            "the text below scrubbed of addresses, paths and secrets; for the gateway's own, the text below.</p>",
            how, envelope,
        )  # fmt: skip

    @admin.display(description="endpoints")
    def endpoints(self, row: MessageRequest) -> SafeString:
        pool = WorkerPool.objects.filter(name=row.pool_name).values_list("pk", flat=True).first() if row.pool_name else None
        urls = [u for u in (row.context_endpoint, row.generation_endpoint) if u]
        known = {
            e["url"].rstrip("/"): e["pk"]
            for e in WorkerEndpoint.objects.filter(url__in=urls + [u + "/" for u in urls]).values("url", "pk")
        }

        def link(url: str) -> SafeString:
            if not url:
                return format_html("{}", "—")
            pk = known.get(url.rstrip("/"))
            if pk is None:
                return format_html("{} (no longer registered)", url)
            return format_html('<a href="{}">{}</a>', reverse("admin:workers_workerendpoint_change", args=[pk]), url)

        pool_html = (
            format_html('<a href="{}">{}</a>', reverse("admin:workers_workerpool_change", args=[pool]), row.pool_name)
            if pool is not None else format_html("{}", row.pool_name or "—")
        )  # fmt: skip
        failed_at = row.stage if row.status == RequestStatus.FAILED else ""
        return format_html(
            '<dl class="gw-kv"><dt>pool</dt><dd>{}</dd><dt>context</dt><dd>{}{}</dd><dt>generation</dt><dd>{}{}</dd></dl>',
            pool_html,
            link(row.context_endpoint), FAILED_HERE if failed_at == "context" else "",
            link(row.generation_endpoint), FAILED_HERE if failed_at == "generation" else "",
        )  # fmt: skip

    @admin.display(description="reservations")
    def reservations(self, row: MessageRequest) -> SafeString:
        held = list(
            Reservation.objects.filter(request_id=row.request_id)
            .order_by("reserved_at")
            .values_list("stage", "endpoint_url", "reserved_at", "released_at", "outcome")
        )
        if not held:
            return format_html("{}", "none (no worker was reserved)")
        lines = (
            (stage, url, reserved.strftime("%H:%M:%S.%f")[:-3], released.strftime("%H:%M:%S.%f")[:-3] if released else "open", outcome or "—")
            for stage, url, reserved, released, outcome in held
        )  # fmt: skip
        return format_html(
            '<table class="gw-reservations"><thead><tr><th>stage</th><th>endpoint</th><th>reserved</th><th>released</th><th>outcome</th></tr></thead>'
            "<tbody>{}</tbody></table>",
            format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", lines),
        )


@admin.register(ApiKey)
class ApiKeyAdmin(GuardedAdmin[ApiKey], KeyUsagePages):  # a ModelAdmin, with the per-key usage page and its CSV
    secret_fields = ("key_hash",)
    list_display = ("name", "prefix", "active", "priority", "max_concurrency", "requests_per_minute", "tokens_per_day", "last_used_at")
    list_filter = ("active", "priority")
    search_fields = ("name", "prefix", "cache_group")
    fieldsets = (
        (None, {"fields": ("name", "active", "prefix", "created_at", "last_used_at", "cache_group")}),
        (
            "Limits (empty: none)",
            {
                "fields": (
                    "priority", "max_concurrency", ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute"),
                    ("tokens_per_day", "tokens_per_month"), "allowed_models",
                )
            },
        ),
    )
    readonly_fields = ("prefix", "created_at", "last_used_at")

    def save_model(self, request: HttpRequest, obj: ApiKey, form: ModelForm[ApiKey], change: bool) -> None:
        if not change:
            key = generate_key()
            obj.key_hash = hash_key(key)
            obj.prefix = key[: len(KEY_PREFIX) + 6]
            request._new_api_key = key  # type: ignore[attr-defined]
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None) -> HttpResponse:
        # Rendered directly rather than through a redirect and a message: the key must not be
        # stored anywhere, not even in the messages cookie or the session table.
        key = getattr(request, "_new_api_key", None)
        if key is None:
            return super().response_add(request, obj, post_url_continue)
        context = {**self.admin_site.each_context(request), "api_key": obj, "key": key, "title": "API key created"}
        return TemplateResponse(request, "admin/messages_api/apikey/created.html", context)
from messages_api.batches import admin as batches_admin  # noqa: E402,F401  # registers MessageBatchAdmin
