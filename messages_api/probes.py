"""Load-balancer probes (`/health`, `/ready`) and the metrics scrape, answered before Django's host
check.

Load balancers and Prometheus address a backend by its IP (`Host: 10.0.0.7:8000`), which
ALLOWED_HOSTS rightly refuses for the admin. These three views build nothing from the Host header
(no absolute URL, no redirect, no cookie), so the host check protects nothing there; every other
path still goes through the full middleware stack and its host check.

It is a middleware at the top of the stack rather than a route in the ASGI router because the
router belongs to the API's consumers; here the probes stay Django views and need no second
dispatch table. Being first, it also keeps SecurityMiddleware's HTTPS redirect off the probes,
which arrive as plain HTTP from inside the network even when the public side is TLS-only.

`/health` is not here: it is answered before Django (messages_api/liveness.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from asgiref.sync import markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase

from messages_api import views

# A view answers directly (health, metrics) or through a coroutine (ready).
ProbeView = Callable[[HttpRequest], HttpResponseBase | Awaitable[HttpResponseBase]]

PROBE_VIEWS: dict[str, ProbeView] = {
    "/ready": views.ready,
    "/metrics": views.metrics,
}


class ProbeMiddleware:
    """Serves PROBE_VIEWS for any Host; passes everything else on unchanged."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        view = PROBE_VIEWS.get(request.path_info)
        if view is None:
            return await self.get_response(request)
        # The sync views answer from memory (health, metrics): no thread hop needed. The async
        # one (ready) returns its coroutine here, awaited below.
        response = view(request)
        if inspect.isawaitable(response):
            return await response
        return response


