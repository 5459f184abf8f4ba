"""HTTP routing: the API paths go to the Channels consumers, everything else to Django.

Every path under `/v1` belongs to the API: one that is not routed here answers Anthropic's 404
envelope (`not_found_error`) rather than Django's HTML page, which an SDK cannot read.
"""

from __future__ import annotations

from typing import Any

import orjson
from channels.routing import URLRouter
from django.urls import path, re_path

from messages_api.audit import new_request_id
from messages_api.consumers import CountTokensConsumer, MessagesConsumer, ModelsConsumer
from messages_api.errors import error_body


def http_application(django_asgi_app: Any) -> Any:
    return URLRouter(
        [
            path("v1/messages", MessagesConsumer.as_asgi()),
            path("v1/messages/count_tokens", CountTokensConsumer.as_asgi()),
            path("v1/models", ModelsConsumer.as_asgi()),
            path("v1/models/<str:model_id>", ModelsConsumer.as_asgi()),
            re_path(r"^v1(?:/|$)", api_not_found),
            re_path(r"", django_asgi_app),
        ]
    )


async def api_not_found(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An API path this gateway does not serve (the batches and files APIs, a typo, ...)."""
    request_id = new_request_id()
    body = orjson.dumps(error_body("not_found_error", f"Not found: {scope.get('method', 'GET')} {scope['path']}", request_id))
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"request-id", request_id.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
