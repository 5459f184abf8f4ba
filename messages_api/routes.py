"""HTTP routing: the API paths go to the Channels consumers, everything else to Django.

Every path under `/v1` belongs to the API: one that is not routed here answers Anthropic's 404
envelope (`not_found_error`) rather than Django's HTML page, which an SDK cannot read.

`requires_api_key(path)` says whether a path goes to one of the consumers (all of which require
a key), matched as the router matches it: the HTTP intake guard checks the key of those requests
from their headers, before their body is read (messages_api/server/header_gate.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from channels.routing import URLRouter
from django.conf import settings
from django.urls import path, re_path
from django.urls.resolvers import RoutePattern

from messages_api import liveness
from messages_api.audit import new_request_id
from messages_api.batches.consumers import BatchCancelConsumer, BatchConsumer, BatchesConsumer, BatchResultsConsumer
from messages_api.consumers import CountTokensConsumer, MessagesConsumer, ModelsConsumer
from messages_api.errors import error_body

if TYPE_CHECKING:
    from channels.routing import _ExtendedURLPattern


# The consumers' routes: every one requires an API key.
API_ROUTES = (
    ("v1/messages", MessagesConsumer),
    ("v1/messages/count_tokens", CountTokensConsumer),
    ("v1/models", ModelsConsumer),
    ("v1/models/<str:model_id>", ModelsConsumer),
    ("v1/messages/batches", BatchesConsumer),
    ("v1/messages/batches/<str:batch_id>", BatchConsumer),
    ("v1/messages/batches/<str:batch_id>/cancel", BatchCancelConsumer),
    ("v1/messages/batches/<str:batch_id>/results", BatchResultsConsumer),
)
_KEYED_PATTERNS = tuple((RoutePattern(route, is_endpoint=True), consumer) for route, consumer in API_ROUTES)


def http_application(django_asgi_app: Any) -> Any:
    return URLRouter(
        [
            *(_asgi_path(route, consumer.as_asgi()) for route, consumer in API_ROUTES),
            _asgi_path("health", liveness.health),  # answered before Django (messages_api/liveness.py)
            _asgi_re_path(r"^v1(?:/|$)", api_not_found),
            _asgi_re_path(r"", django_asgi_app),
        ]
    )


def requires_api_key(scope_path: str) -> bool:
    """Whether the router sends a request for `scope_path` (the ASGI scope's `path`: percent-decoded,
    with no root path) to a consumer. Channels' URLRouter strips the leading slashes first."""
    stripped = scope_path.lstrip("/")
    return any(pattern.match(stripped) for pattern, _ in _KEYED_PATTERNS)


def body_limit(scope_path: str) -> int:
    """The largest body the consumer routed `scope_path` takes (MESSAGES_MAX_BODY_BYTES, unless
    the route has its own: a batch's create, BATCH_MAX_BYTES)."""
    stripped = scope_path.lstrip("/")
    for pattern, consumer in _KEYED_PATTERNS:
        if pattern.match(stripped):
            return consumer.max_body_bytes()
    limit: int = settings.MESSAGES_MAX_BODY_BYTES
    return limit


# django-stubs types `path()`'s target as a Django view and its result as a plain URLPattern;
# Channels' URLRouter takes patterns whose target is an ASGI application (the documented use), which
# its stubs call `_ExtendedURLPattern`. These two say so once, for every route above.
def _asgi_path(route: str, application: Callable[..., Awaitable[None]]) -> _ExtendedURLPattern:
    """`django.urls.path()` to an ASGI application, for URLRouter."""
    return path(route, application)  # type: ignore[arg-type,return-value]


def _asgi_re_path(route: str, application: Callable[..., Awaitable[None]]) -> _ExtendedURLPattern:
    """`django.urls.re_path()` to an ASGI application, for URLRouter."""
    return re_path(route, application)  # type: ignore[arg-type,return-value]


async def api_not_found(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An API path this gateway does not serve (the files API, a typo, ...)."""
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
