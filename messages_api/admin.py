from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.forms import ModelForm
from django.http import HttpRequest

from messages_api.auth import generate_key, hash_key, KEY_PREFIX
from messages_api.models import ApiKey, MessageRequest
from workers.admin import ReadOnlyAdmin


@admin.register(MessageRequest)
class MessageRequestAdmin(ReadOnlyAdmin):
    list_display = (
        "request_id", "received_at", "model", "stream", "status", "stage", "http_status",
        "error_type", "first_token_ms", "finished_ms", "input_tokens", "output_tokens", "api_key_name",
    )
    list_filter = (
        "status", "stage", "stream", "error_type", "pool_name", "context_endpoint", "generation_endpoint", "received_at",
    )
    search_fields = ("request_id", "error_message", "model")
    date_hierarchy = "received_at"
    fieldsets = (
        (None, {"fields": ("request_id", "received_at", "model", "stream", "api_key_name", "gateway_instance")}),
        ("Outcome", {"fields": ("status", "stage", "http_status", "error_type", "error_message")}),
        ("Route", {"fields": ("pool_name", "context_endpoint", "generation_endpoint")}),
        ("Timings (ms after receipt)", {"fields": ("headers_sent_ms", "context_done_ms", "first_token_ms", "finished_ms", "pings_sent")}),
        ("Usage", {"fields": ("input_tokens", "output_tokens")}),
    )


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "active", "created_at", "last_used_at")
    list_filter = ("active",)
    search_fields = ("name", "prefix")
    fields = ("name", "active", "prefix", "created_at", "last_used_at")
    readonly_fields = ("prefix", "created_at", "last_used_at")

    def save_model(self, request: HttpRequest, obj: ApiKey, form: ModelForm, change: bool) -> None:
        if not change:
            key = generate_key()
            obj.key_hash = hash_key(key)
            obj.prefix = key[: len(KEY_PREFIX) + 6]
            super().save_model(request, obj, form, change)
            # The only time the key is shown: it is not stored.
            messages.warning(request, f"The new API key for {obj.name!r} is {key} — copy it now, it will not be shown again.")
            return
        super().save_model(request, obj, form, change)
