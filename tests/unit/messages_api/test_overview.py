"""The operator's console in the admin: the cluster overview (its numbers, who sees what, its
bounded cost), the index that links to it, the audit list and detail page, and the pool and
endpoint pages (one line per endpoint, options on the endpoint's own page)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client, RequestFactory
from django.urls import reverse

from messages_api import overview
from messages_api.models import ApiKey, MessageRequest
from workers.admission import queue as admission_queue
from workers.admission.queue import Priority
from workers.models import Reservation, WorkerEndpoint, WorkerPool

pytestmark = pytest.mark.django_db

NOW = datetime.now(timezone.utc)
LONG_ERROR = "the worker said: " + "x" * 900 + " END-OF-THE-WORKER-TEXT"


def client_with(*codenames: str, superuser: bool = False, name: str = "op") -> Client:
    users = get_user_model().objects
    if superuser:
        user = users.create_superuser(name, f"{name}@example.com", "pw")
    else:
        user = users.create_user(name, f"{name}@example.com", "pw", is_staff=True)
        user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def audit(request_id: str, *, ago_s: float = 30, status: str = "completed", **fields: Any) -> MessageRequest:
    defaults: dict[str, Any] = {"model": "m", "pool_name": "alpha", "stage": "done", "api_key_name": "tenant"}
    return MessageRequest.objects.create(
        request_id=request_id, received_at=NOW - timedelta(seconds=ago_s), status=status, **{**defaults, **fields}
    )


@pytest.fixture
def cluster(db: Any) -> dict[str, Any]:
    pool = WorkerPool.objects.create(name="alpha", model="m", handoff_signing_key="never-shown-signing-key")
    context = WorkerEndpoint.objects.create(pool=pool, role="context", url="http://10.0.0.1:8001", options={"bootstrap_port": 8998})
    generation = WorkerEndpoint.objects.create(
        pool=pool, role="generation", url="http://10.0.0.2:8002", capacity=4, healthy=False, last_error="connection refused"
    )
    for i in range(3):
        Reservation.objects.create(
            reservation_id=f"open-{i}", request_id=f"req_open{i}", endpoint=generation, endpoint_url=generation.url,
            pool_name="alpha", stage="generation", reserved_at=NOW,
        )  # fmt: skip
    Reservation.objects.create(
        reservation_id="closed", request_id="req_closed", endpoint=generation, endpoint_url=generation.url, pool_name="alpha",
        stage="generation", reserved_at=NOW - timedelta(seconds=5), released_at=NOW, outcome="success",
    )  # fmt: skip
    # The last 15 minutes: 10 completed with a first token of 100 … 1000 ms, 2 failed in context
    # (one through each endpoint), 1 rejected; and rows outside the window that must not count.
    for i in range(10):
        audit(f"req_ok{i}", first_token_ms=100.0 * (i + 1), finished_ms=2000.0, context_endpoint=context.url, generation_endpoint=generation.url)
    audit("req_fail_ctx", ago_s=20, status="failed", stage="context", http_status=503, error_type="overloaded_error",
          error_message=LONG_ERROR, context_endpoint=context.url, generation_endpoint=generation.url, finished_ms=4.0)  # fmt: skip
    audit("req_fail_gen", ago_s=25, status="failed", stage="generation", http_status=502, error_type="api_error", error_message="stream broken",
          context_endpoint=context.url, generation_endpoint=generation.url, context_done_ms=50.0, finished_ms=80.0)  # fmt: skip
    audit("req_rejected", status="rejected", stage="received", http_status=429, error_type="rate_limit_error", error_message="slow down")
    audit("req_old", ago_s=3600, status="failed", stage="context", error_type="api_error", error_message="an hour ago", first_token_ms=99999.0)
    audit("req_older", ago_s=3 * 86400, status="failed", stage="context", error_type="api_error", error_message="days ago")
    return {"pool": pool, "context": context, "generation": generation}


def context_for(*codenames: str, superuser: bool = True) -> dict[str, Any]:
    users = get_user_model().objects
    user = users.create_superuser("ctx", "ctx@example.com", "pw") if superuser else users.create_user("ctx", is_staff=True)
    if not superuser:
        user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    request = RequestFactory().get("/")
    request.user = user
    return overview.context(request, NOW)


# --- the overview's numbers ------------------------------------------------------------------------


def test_the_overview_counts_the_window_from_the_audit(cluster: dict[str, Any]) -> None:
    page = context_for()
    figures = {label: (value, note) for label, value, note in page["figures"]}
    assert figures["requests / min"][1] == "13 in 15 min"
    assert figures["error rate"] == ("23.1%", "3 errors, 2 failed")
    # Nearest rank over 100 … 1000 ms: p50 is the 5th, p99 the 10th; the hour-old row is outside.
    assert figures["first token p50"][0] == "500 ms" and figures["first token p99"][0] == "1,000 ms"
    assert figures["open reservations"][0] == "3"
    assert figures["unhealthy endpoints"][0] == "1 of 2"
    assert [(e["type"], e["count"], e["failed"], e["rejected"]) for e in page["errors_by_type"]] == [
        ("api_error", 1, 1, 0), ("overloaded_error", 1, 1, 0), ("rate_limit_error", 1, 0, 1),
    ]  # fmt: skip
    # The requests chart: 13 requests and 3 errors in the current minute's bucket or the one before.
    requests_chart = str(page["charts"][0])
    assert requests_chart.count('data-series="requests"') == overview.WINDOW_MINUTES
    assert sum(int(v) for v in _values(requests_chart, "requests")) == 13
    assert sum(int(v) for v in _values(requests_chart, "errors")) == 3


def _values(svg: str, series: str) -> list[str]:
    marker = f'data-series="{series}" data-value="'
    return [part.split('"', 1)[0] for part in svg.split(marker)[1:]]


def test_each_endpoint_shows_its_load_capacity_health_and_failures(cluster: dict[str, Any]) -> None:
    (pool,) = context_for()["pools"]
    assert pool.name == "alpha" and pool.routable == {"context": (1, 1), "generation": (0, 1)}
    context, generation = pool.endpoints
    assert (context.role, context.healthy, context.open_all, context.capacity, context.requests, context.failed) == (
        "context", True, 0, None, 12, 1,
    )  # fmt: skip
    assert (generation.healthy, generation.last_error, generation.open_all, generation.capacity, generation.full) == (
        False, "connection refused", 3, 4, False,
    )  # fmt: skip
    assert (generation.requests, generation.failed) == (12, 1)
    # This process holds nothing and its breakers are closed.
    assert (generation.breaker, generation.open_here, generation.probed_here) == ("closed", 0, None)
    assert pool.queued == {role: {"interactive": 0, "standard": 0, "batch": 0} for role in ("context", "generation")}


def test_the_queue_depth_here_is_read_per_pool_role_and_class(cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeQueue:
        waiting = {
            (("alpha", "generation"), Priority.INTERACTIVE): 2,
            (("alpha", "generation"), Priority.BATCH): 5,
            (("beta", "context"), Priority.STANDARD): 1,
        }

    monkeypatch.setattr(admission_queue, "_queues", {object(): FakeQueue()})
    (pool,) = context_for()["pools"]
    assert pool.queued["generation"] == {"interactive": 2, "standard": 0, "batch": 5}
    assert pool.queued["context"] == {"interactive": 0, "standard": 0, "batch": 0}


async def test_a_real_queue_counts_its_waiters_by_resource_and_class() -> None:
    import asyncio

    from workers.admission.queue import AdmissionQueue, Ticket, _Waiter

    queue = AdmissionQueue()
    loop = asyncio.get_running_loop()
    waiters = [_Waiter(Ticket(flow="k", priority=Priority.BATCH), ("alpha", "generation"), loop.create_future()) for _ in range(2)]
    for waiter in waiters:
        queue._enqueue(waiter)
    assert dict(queue.waiting) == {(("alpha", "generation"), Priority.BATCH): 2}
    queue.leave(waiters[0], "cancelled")
    queue.leave(waiters[1], "cancelled")
    assert dict(queue.waiting) == {}


def test_the_last_failed_requests_are_the_newest_of_a_day_with_links(cluster: dict[str, Any]) -> None:
    failed = context_for()["failed"]
    # Newest first; the rejected one is not a failure; three days ago is outside the lookback.
    assert [r["request_id"] for r in failed] == ["req_fail_ctx", "req_fail_gen", "req_old"]
    first = failed[0]
    assert first["url"] == reverse("admin:messages_api_messagerequest_change", args=[MessageRequest.objects.get(request_id=first["request_id"]).pk])


def test_the_overview_costs_a_bounded_number_of_queries(cluster: dict[str, Any], django_assert_max_num_queries: Any) -> None:
    for i in range(200):
        audit(f"req_bulk{i}", first_token_ms=float(i), ago_s=i % 800)
    request = RequestFactory().get("/")
    request.user = get_user_model().objects.create_superuser("q", "q@example.com", "pw")
    with django_assert_max_num_queries(10):
        overview.context(request, NOW)


def test_percentiles_by_nearest_rank() -> None:
    assert overview.percentile([], 0.5) is None
    assert overview.percentile([7.0], 0.99) == 7.0
    values = [float(v) for v in range(1, 101)]
    assert (overview.percentile(values, 0.5), overview.percentile(values, 0.99), overview.percentile(values, 1.0)) == (50.0, 99.0, 100.0)


# --- who sees what -----------------------------------------------------------------------------------


def test_the_overview_is_for_staff_with_view_permissions(cluster: dict[str, Any]) -> None:
    url = reverse("admin:cluster_overview")
    anonymous = Client().get(url)
    assert anonymous.status_code == 302 and reverse("admin:login") in anonymous["Location"]
    assert client_with(name="nobody").get(url).status_code == 403
    assert client_with(name="nobody2").get(reverse("admin:cluster_overview_live")).status_code == 403

    audit_only = client_with("view_messagerequest", name="auditor").get(url).content.decode()
    assert "req_fail_ctx" in audit_only and "Errors by type" in audit_only
    assert "Pools and endpoints" not in audit_only, audit_only[audit_only.find("Pools and endpoints") - 300:][:400]

    cluster_only = client_with("view_workerpool", "view_workerendpoint", name="clusterop").get(url).content.decode()
    assert "Pools and endpoints" in cluster_only and "10.0.0.2:8002" in cluster_only
    assert "req_fail_ctx" not in cluster_only and "Errors by type" not in cluster_only


def test_the_page_and_its_live_part(cluster: dict[str, Any]) -> None:
    root = client_with(superuser=True)
    page = root.get(reverse("admin:cluster_overview"), {"every": "2"})
    html = page.content.decode()
    assert page.status_code == 200
    assert 'id="overview"' in html and 'data-refresh-ms="2000"' in html and "messages_api/admin/overview.js" in html
    assert 'data-request-id="req_fail_ctx"' in html and "never-shown-signing-key" not in html
    live = root.get(reverse("admin:cluster_overview_live"))
    assert live.status_code == 200 and live["X-Overview-Live"] == "1"
    assert "no-cache" in live["Cache-Control"] or "max-age=0" in live["Cache-Control"]
    body = live.content.decode()
    assert body.lstrip().startswith("{#") is False and 'id="overview-live"' in body and "<html" not in body
    # The live part is what the page shows.
    assert 'data-request-id="req_fail_gen"' in body


def test_the_refresh_interval_is_bounded(cluster: dict[str, Any]) -> None:
    root = client_with(superuser=True)
    for asked, shown in (("0", "1000"), ("100000", "300000"), ("nan", "5000"), ("soon", "5000")):
        assert f'data-refresh-ms="{shown}"' in root.get(reverse("admin:cluster_overview"), {"every": asked}).content.decode()


def test_the_index_says_what_the_cluster_is_doing_and_links_to_the_overview(cluster: dict[str, Any]) -> None:
    html = client_with(superuser=True).get(reverse("admin:index")).content.decode()
    assert 'id="console-summary"' in html and reverse("admin:cluster_overview") in html
    assert "<strong>1</strong> of 2 endpoints routable" in html
    assert "<strong>13</strong> requests" in html
    assert "Operations" in html and "Cluster overview" in html
    # Someone who may see neither gets Django's own index.
    assert 'id="console-summary"' not in client_with(name="plain").get(reverse("admin:index")).content.decode()


# --- the audit ---------------------------------------------------------------------------------------


def test_the_audit_list_is_one_line_per_request(cluster: dict[str, Any]) -> None:
    html = client_with(superuser=True).get(reverse("admin:messages_api_messagerequest_changelist")).content.decode()
    for column in ("request_link", "received", "key", "model_name", "status_badge", "stage", "http", "error", "ttft", "total"):
        assert f"column-{column}" in html, column
    assert "req_fail_ctx" in html and "overloaded_error" in html
    # The long message is cut in the list (its start shown, its end only on the detail page).
    assert "the worker said: xxx" in html and "END-OF-THE-WORKER-TEXT" not in html
    assert "messages_api/admin/console.css" in html


def test_the_detail_page_reads_a_failure(cluster: dict[str, Any]) -> None:
    row = MessageRequest.objects.get(request_id="req_fail_gen")
    Reservation.objects.create(
        reservation_id="r-gen", request_id=row.request_id, endpoint=cluster["generation"], endpoint_url=cluster["generation"].url,
        pool_name="alpha", stage="generation", reserved_at=NOW, released_at=NOW, outcome="failure",
    )  # fmt: skip
    html = client_with(superuser=True).get(reverse("admin:messages_api_messagerequest_change", args=[row.pk])).content.decode()
    assert 'class="gw-timeline"' in html
    assert "never: ended in the generation stage (failed)" in html  # no first token
    assert "as the HTTP answer: status <code>502</code>" in html and "&quot;api_error&quot;" in html
    assert "stream broken" in html  # as recorded
    assert reverse("admin:workers_workerendpoint_change", args=[cluster["generation"].pk]) in html
    assert reverse("admin:workers_workerpool_change", args=[cluster["pool"].pk]) in html
    assert "failed here" in html and "r-gen" not in html and "failure" in html
    # The whole worker text is on the detail page of the row that has it.
    long_row = MessageRequest.objects.get(request_id="req_fail_ctx")
    detail = client_with(superuser=True, name="op2").get(reverse("admin:messages_api_messagerequest_change", args=[long_row.pk]))
    assert "END-OF-THE-WORKER-TEXT" in detail.content.decode()


def test_a_streamed_failure_after_the_status_line_is_an_error_event(db: Any) -> None:
    row = audit("req_late", status="failed", stage="generation", stream=True, http_status=200, headers_sent_ms=300.0,
                error_type="api_error", error_message="cut", first_token_ms=400.0, finished_ms=900.0)  # fmt: skip
    html = client_with(superuser=True).get(reverse("admin:messages_api_messagerequest_change", args=[row.pk])).content.decode()
    assert "as an <code>error</code> event in the stream" in html


# --- the cluster's pages ----------------------------------------------------------------------------


def test_the_pool_page_puts_each_endpoint_on_one_line(cluster: dict[str, Any]) -> None:
    html = client_with(superuser=True).get(reverse("admin:workers_workerpool_change", args=[cluster["pool"].pk])).content.decode()
    assert 'name="endpoints-0-options"' not in html  # edited on the endpoint's own page
    assert "Currently:" not in html  # the admin's two-line URL widget
    assert 'name="endpoints-0-url"' in html and 'name="endpoints-1-capacity"' in html
    assert "connection refused" in html  # the health column's detail
    assert reverse("admin:workers_workerendpoint_change", args=[cluster["context"].pk]) in html
    assert "bootstrap_port=8998" in html
    assert "never-shown-signing-key" not in html
    assert "workers/admin/cluster.css" in html


def test_the_endpoint_page_edits_its_options(cluster: dict[str, Any]) -> None:
    root = client_with(superuser=True)
    html = root.get(reverse("admin:workers_workerendpoint_change", args=[cluster["context"].pk])).content.decode()
    assert 'name="options"' in html and "bootstrap_port" in html
    listing = root.get(reverse("admin:workers_workerendpoint_changelist")).content.decode()
    assert "connection refused" in listing and ">3<" in listing  # health and open reservations


@pytest.mark.filterwarnings("error::django.utils.deprecation.RemovedInDjango60Warning")
def test_the_endpoint_page_takes_a_url_without_a_scheme_as_http(cluster: dict[str, Any]) -> None:
    # Workers speak plain HTTP (as the pool page's inline form says); Django 6 would default to https.
    from django.contrib import admin

    request = RequestFactory().get("/")
    request.user = get_user_model().objects.create_superuser("root-url", password="x")
    form = admin.site._registry[WorkerEndpoint].get_form(request, cluster["context"])
    assert form.base_fields["url"].clean("10.0.0.9:8001") == "http://10.0.0.9:8001"


def test_the_model_routes_list_links_its_pools(cluster: dict[str, Any]) -> None:
    from workers.models import ModelRoute, ModelRoutePool

    route = ModelRoute.objects.create(name="claude-*")
    ModelRoutePool.objects.create(route=route, pool=cluster["pool"], position=0)
    html = client_with(superuser=True).get(reverse("admin:workers_modelroute_changelist")).content.decode()
    assert "pattern" in html and reverse("admin:workers_workerpool_change", args=[cluster["pool"].pk]) in html


def test_api_key_pages_still_work(db: Any) -> None:
    key = ApiKey.objects.create(name="t", key_hash="c" * 64, prefix="sk-gw-cccccc")
    root = client_with(superuser=True)
    assert root.get(reverse("admin:messages_api_apikey_change", args=[key.pk])).status_code == 200
    assert root.get(reverse("admin:messages_api_apikey_usage", args=[key.pk])).status_code == 200


def test_each_endpoint_shows_its_engines_queue_and_kv_use_and_whether_they_are_fresh(
    cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from workers.cluster.engine_load import _entry, engine_loads
    from workers.protocols.engine_load import EngineLoad

    context, generation = cluster["context"], cluster["generation"]
    monkeypatch.setitem(engine_loads.view, generation.id, _entry(EngineLoad(12, 3, 0.5), time.time(), polled_here=True))
    monkeypatch.setitem(engine_loads.view, context.id, _entry(EngineLoad(1, 0, None), time.time() - 3600, polled_here=False))
    (pool,) = context_for()["pools"]
    shown = {e.role: e.engine for e in pool.endpoints}
    assert shown["generation"].load == EngineLoad(12, 3, 0.5) and shown["generation"].fresh
    assert not shown["context"].fresh
    html = client_with(superuser=True, name="engine").get(reverse("admin:cluster_overview_live")).content.decode()
    assert "12 waiting · KV 50%" in html
    assert "1 waiting (stale)" in html and "routing uses the gateway's own counts" in html
    assert "admission held" not in html  # ENGINE_LOAD_ADMIT_MAX_* off


def test_an_endpoint_whose_engine_holds_admission_says_so(cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from django.test import override_settings

    from workers.cluster.engine_load import _entry, engine_loads
    from workers.protocols.engine_load import EngineLoad

    with override_settings(ENGINE_LOAD_ADMIT_MAX_WAITING=10):
        monkeypatch.setitem(engine_loads.view, cluster["generation"].id, _entry(EngineLoad(12, 3, 0.5), time.time(), polled_here=True))
        monkeypatch.setitem(engine_loads.view, cluster["context"].id, _entry(EngineLoad(2, 3, 0.5), time.time(), polled_here=True))
    html = client_with(superuser=True, name="engine").get(reverse("admin:cluster_overview_live")).content.decode()
    assert html.count("admission held") == 1 and "12 waiting · KV 50% · <span" in html
