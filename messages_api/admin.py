from __future__ import annotations

from django.contrib import admin
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from messages_api.auth import KEY_PREFIX, generate_key, hash_key
from messages_api.models import ApiKey, MessageRequest
from messages_api.usage_report import KeyUsagePages
from workers import GuardedAdmin, ReadOnlyAdmin


@admin.register(MessageRequest)
class MessageRequestAdmin(ReadOnlyAdmin[MessageRequest]):
    list_display = ("request_id", "received_at", "model", "stream", "status", "stage", "http_status", "error", "first_token_ms", "finished_ms")
    list_filter = (
        "status", "stage", "stream", "error_type", "pool_name", "context_endpoint", "generation_endpoint", "received_at",
    )
    search_fields = ("request_id", "error_message", "model")

    @admin.display(description="error", ordering="error_type")
    def error(self, row: MessageRequest) -> str:
        if not row.error_type:
            return ""
        message = row.error_message if len(row.error_message) <= 80 else row.error_message[:79] + "…"
        return f"{row.error_type}: {message}"
    date_hierarchy = "received_at"
    fieldsets = (
        (None, {"fields": ("request_id", "received_at", "model", "stream", "api_key_name", "gateway_instance")}),
        ("Outcome", {"fields": ("status", "stage", "http_status", "error_type", "error_message")}),
        ("Route", {"fields": ("pool_name", "context_endpoint", "generation_endpoint")}),
        ("Timings (ms after receipt)", {"fields": ("headers_sent_ms", "queued_ms", "context_done_ms", "first_token_ms", "finished_ms", "pings_sent")}),
        ("Usage", {"fields": ("input_tokens", "output_tokens", "cache_read_input_tokens")}),
    )


@admin.register(ApiKey)
class ApiKeyAdmin(GuardedAdmin[ApiKey], KeyUsagePages):  # a ModelAdmin, with the per-key usage page and its CSV
    secret_fields = ("key_hash",)
    list_display = ("name", "prefix", "active", "priority", "max_concurrency", "requests_per_minute", "tokens_per_day", "last_used_at")
    list_filter = ("active", "priority")
    search_fields = ("name", "prefix")
    fieldsets = (
        (None, {"fields": ("name", "active", "prefix", "created_at", "last_used_at")}),
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
