"""HTTP routing: the API paths go to the Channels consumers, everything else to Django."""

from __future__ import annotations

from typing import Any

from channels.routing import URLRouter
from django.urls import path, re_path

from messages_api.consumers import CountTokensConsumer, MessagesConsumer, ModelsConsumer


def http_application(django_asgi_app: Any) -> Any:
    return URLRouter(
        [
            path("v1/messages", MessagesConsumer.as_asgi()),
            path("v1/messages/count_tokens", CountTokensConsumer.as_asgi()),
            path("v1/models", ModelsConsumer.as_asgi()),
            path("v1/models/<str:model_id>", ModelsConsumer.as_asgi()),
            re_path(r"", django_asgi_app),
        ]
    )
