"""Small plain-Django routes: the root probe Claude Code sends (`HEAD /`), liveness and readiness,
the metrics scrape; and Django's error pages (400, 404, 500) in Anthropic's envelope."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.exposition import choose_encoder

from messages_api.audit import new_request_id
from messages_api.errors import INTERNAL_ERROR_MESSAGE, error_body
from messages_api.server import drain
from messages_api.server.header_gate import metrics_refusal
from workers import AGGREGATED, PoolInfo, get_registry, routable


@require_safe
def root(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"service": "disaggregated messages gateway", "messages": "/v1/messages"})


def _database_reachable() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except Exception:
        return False
    finally:
        close_old_connections()


@require_safe
async def ready(request: HttpRequest) -> JsonResponse:
    """Readiness: the database answers and every pool has a routable endpoint of each role its
    schedule uses (an aggregated pool has no context phase, so it needs generation endpoints only);
    routable as the router routes, endpoints only slow to answer their probes included when their
    role has nothing else (`workers.routing.fallback`).

    Pools are listed by name and id with counts only: worker addresses are not for anonymous eyes.
    """
    database = await sync_to_async(_database_reachable, thread_sensitive=False)()
    pools = {}
    ready = database
    if database:
        snapshot = await get_registry().snapshot()
        for pool in snapshot.pools:
            counts = {}
            for role in ("context", "generation"):
                endpoints = pool.endpoints_for(role)
                counts[role] = {"registered": len(endpoints), "routable": len(routable(pool, role))}
                if role in _roles_needed(pool):
                    ready = ready and counts[role]["routable"] > 0
            pools[pool.name] = {"id": pool.id, "model": pool.model, **counts}
        ready = ready and bool(snapshot.pools)
    # A process finishing its requests after SIGTERM takes no new ones (messages_api/server/drain.py).
    status = "draining" if drain.is_draining() else "ready" if ready else "not ready"
    return JsonResponse(
        {"status": status, "database": "ok" if database else "unreachable", "pools": pools},
        status=200 if status == "ready" else 503,
    )


def _roles_needed(pool: PoolInfo) -> tuple[str, ...]:
    if pool.schedule_style == AGGREGATED:
        return ("generation",)
    return ("context", "generation")


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus metrics of this process. They name worker endpoints, so they are served to
    loopback clients, or (METRICS_TOKEN set) only to those presenting it. Under daphne the intake
    guard has already applied this rule to the socket's own peer (messages_api/server/header_gate.py);
    here it is applied again to the address the server reports, for other servers."""
    # Django decodes header values as latin-1: encoded back, they are the bytes that were sent.
    authorization = request.headers.get("Authorization")
    authorizations = [authorization.encode("latin-1")] if authorization is not None else []
    forwarded = any(request.META.get(name) for name in ("HTTP_X_FORWARDED_FOR", "HTTP_FORWARDED", "HTTP_X_REAL_IP"))
    refusal = metrics_refusal(authorizations, request.META.get("REMOTE_ADDR"), forwarded)
    if refusal is not None:
        return error_response(refusal.status, refusal.error_type, refusal.message)
    accept = request.headers.get("Accept", "")
    if "application/openmetrics-text" in accept:
        # OpenMetrics (what Prometheus asks for first): the only exposition with exemplars, the
        # trace ids on the latency histograms (messages_api/metrics.py).
        encoder, content_type = choose_encoder(accept)
        return HttpResponse(encoder(REGISTRY), content_type=content_type)
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def error_response(status: int, error_type: str, message: str) -> JsonResponse:
    """An answer in Anthropic's envelope, with its `request-id` header."""
    request_id = new_request_id()
    response = JsonResponse(error_body(error_type, message, request_id), status=status)
    response["request-id"] = request_id
    return response


# Django's error views (disagg_project/urls.py): every request target Django does not serve (`*`,
# `/V1/MESSAGES`, an absolute URL, ...) is answered in Anthropic's envelope, not an HTML page.


def not_found(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return error_response(404, "not_found_error", f"Not found: {request.method} {request.path}")


def bad_request(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return error_response(400, "invalid_request_error", "Bad request")


def server_error(request: HttpRequest) -> JsonResponse:
    return error_response(500, "api_error", INTERNAL_ERROR_MESSAGE)
