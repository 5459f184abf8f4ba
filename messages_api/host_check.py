"""The host check (ALLOWED_HOSTS) of the Django side, answered without a traceback.

Django refuses a request whose `Host` is not allowed by raising `DisallowedHost` from the first
middleware that reads the host; its handler logs the exception with its traceback (~2 KB) at
ERROR, once per request, so anyone could fill the log by sending a wrong `Host`. This middleware
(second, after the probes, which answer any host) reads the host first: a bad one is answered
400 in Anthropic's envelope, counted (gateway_bad_host_rejections_total), and logged as one
short line at most AUDIT_UNAUTHENTICATED_SAMPLE_PER_S times a second, each saying how many it
stands for.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponseBase
from prometheus_client import Counter

from messages_api.audit import RateSampler
from messages_api.request_context import loggable
from messages_api.views import error_response

logger = logging.getLogger(__name__)

bad_host_rejections = Counter(
    "gateway_bad_host_rejections", "Requests refused because their Host header is not in ALLOWED_HOSTS."
)
_sampler: RateSampler | None = None


class HostCheckMiddleware:
    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        try:
            request.get_host()
        except DisallowedHost:
            bad_host_rejections.inc()
            _log(request)
            return error_response(400, "invalid_request_error", "The Host header is not a host this gateway serves")
        return await self.get_response(request)


def _log(request: HttpRequest) -> None:
    global _sampler
    if _sampler is None:
        _sampler = RateSampler(settings.AUDIT_UNAUTHENTICATED_SAMPLE_PER_S)
    skipped = _sampler.take()
    if skipped is None:
        return
    host = loggable(request.META.get("HTTP_HOST", "")[:200])
    logger.warning(
        "refused a request from %s for host %s: not in ALLOWED_HOSTS%s",
        request.META.get("REMOTE_ADDR") or "?", host, f" (and {skipped} more not logged since the last)" if skipped else "",
    )
