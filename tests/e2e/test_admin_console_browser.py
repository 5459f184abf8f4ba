"""The operator's console in a real browser (headless Chromium, as tests/e2e/test_admin_browser.py):
the cluster overview shows a failure injected while it is open without the page being reloaded,
and the overview, the audit list and detail, a pool page and the model routes pages fit a
1440 × 900 screen: nothing scrolls sideways, neither the page nor a box inside it.

Screenshots go to .gateway/screenshots/admin-console-*.png.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, SCREENSHOTS, logged_in_page, send
from tests.support.cluster import audit_row, register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)

WIDTH, HEIGHT = 1440, 900
# The page, and every box that scrolls sideways (Django's changelist table sits in one, so a
# table wider than the screen does not show in the page's own width).
OVERFLOW = """() => ({
  page: [document.documentElement.scrollWidth, window.innerWidth],
  boxes: [...document.querySelectorAll('*')]
    .filter(e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX) && e.scrollWidth > e.clientWidth + 1)
    .map(e => `${e.tagName.toLowerCase()}#${e.id}.${e.className}: ${e.scrollWidth} > ${e.clientWidth}`),
})"""


def assert_fits(page: Any, what: str) -> None:
    found = page.evaluate(OVERFLOW)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), (what, found)
    assert found["boxes"] == [], (what, found)


def test_the_operators_console_in_a_browser(
    transactional_db: Any,
    gateways: Any,
    context_worker: SimWorker,
    generation_worker: SimWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # playwright's loop runs on this thread
    from django.contrib.auth import get_user_model
    from django.db import connections
    from django.urls import reverse
    from playwright.sync_api import expect, sync_playwright

    from workers.models import ModelRoute, ModelRoutePool, WorkerEndpoint, WorkerPool

    gateway: Gateway = gateways(HEALTH_CHECK_INTERVAL_S="3600")
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    # A second pool and a route over both, with names as long as operators make them.
    spare = WorkerPool.objects.create(name="pool-secondary-with-a-long-name", model="another-model-with-a-rather-long-name")
    WorkerEndpoint.objects.create(
        pool=spare, role="context", url="http://10.200.100.150:18001/", options={"bootstrap_port": 8998}, enabled=False,
        healthy=False, last_error="connection refused: the worker at http://10.200.100.150:18001 did not answer within 2 s",
    )  # fmt: skip
    route = ModelRoute.objects.create(
        name="claude-sonnet-4-6-and-a-long-suffix", display_name="Claude Sonnet 4.6 (simulated, with a long display name)",
        upstream_model="sim-model-upstream-name",
    )  # fmt: skip
    ModelRoutePool.objects.create(route=route, pool=cluster.pool, position=0)
    ModelRoutePool.objects.create(route=route, pool=spare, position=1)

    # Traffic before anyone looks: one completed and one failed request.
    assert send(gateway, cluster.headers(), cluster.model, "hello [sim tokens=3]").status_code == 200
    earlier = send(gateway, cluster.headers(), cluster.model, "hi [sim context_status=503]")
    assert earlier.status_code == 503, earlier.text
    earlier_row = audit_row(earlier.headers["request-id"])

    password = "operator-password-1"
    get_user_model().objects.create_superuser("operator", "operator@example.com", password)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    site = gateway.url + reverse("admin:index")

    def shot(page: Any, name: str) -> None:
        page.screenshot(path=str(SCREENSHOTS / f"admin-console-{name}.png"), full_page=True)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page, bad_responses = logged_in_page(
                browser, site, "operator", password, timeout_ms=15_000, viewport={"width": WIDTH, "height": HEIGHT}
            )

            # The index says what the cluster is doing and leads to the overview.
            expect(page.locator("#console-summary")).to_contain_text("failed in the last 15 min")
            assert_fits(page, "index")
            shot(page, "index")
            page.click("#overview-link")
            page.wait_for_url("**/overview/")

            # The overview, refreshing every second for the test.
            page.goto(gateway.url + reverse("admin:cluster_overview") + "?every=1")
            expect(page.locator(f"#pool-{cluster.pool.pk}")).to_contain_text(cluster.pool.name)
            expect(page.locator(f'tr.gw-failed-row[data-request-id="{earlier_row.request_id}"]')).to_be_visible()
            expect(page.locator("#overview-figures")).to_contain_text("requests / min")
            expect(page.locator("#overview-charts svg.usage-chart")).to_have_count(2)
            expect(page.locator("#overview-errors")).to_contain_text("overloaded_error")
            assert_fits(page, "overview")
            shot(page, "overview")

            # A failure injected now shows up without a reload.
            page.evaluate("window.__notReloaded = true")
            refreshes = int(page.locator("#overview").get_attribute("data-refreshes") or 0)
            failed = send(gateway, cluster.headers(), cluster.model, "and now [sim context_status=503]")
            assert failed.status_code == 503, failed.text
            failed_id = failed.headers["request-id"]
            row = page.locator(f'tr.gw-failed-row[data-request-id="{failed_id}"]')
            expect(row).to_be_visible(timeout=15_000)
            expect(row).to_contain_text("overloaded_error")
            assert page.evaluate("window.__notReloaded === true"), "the page was reloaded"
            assert int(page.locator("#overview").get_attribute("data-refreshes") or 0) > refreshes
            assert page.locator("#overview-status").inner_text() == ""
            assert_fits(page, "overview after the failure")
            shot(page, "overview-live")

            # From the overview to the failed request's row.
            row.locator("a").click()
            expect(page.locator(".field-request_id")).to_contain_text(failed_id)
            expect(page.locator(".gw-timeline")).to_be_visible()
            expect(page.locator(".field-client_error")).to_contain_text("overloaded_error")
            expect(page.locator(".field-endpoints")).to_contain_text("failed here")
            assert_fits(page, "audit detail")
            shot(page, "audit-detail")

            # The audit list: one line per request, nothing cut off at the right.
            page.goto(gateway.url + reverse("admin:messages_api_messagerequest_changelist"))
            rows = page.locator("#result_list tbody tr")
            expect(rows).to_have_count(3)
            expect(page.locator("#result_list")).to_contain_text(failed_id)
            heights = page.evaluate("[...document.querySelectorAll('#result_list tbody tr')].map(r => r.getBoundingClientRect().height)")
            assert max(heights) < 40, heights
            right = page.evaluate("Math.max(...[...document.querySelectorAll('#result_list th')].map(th => th.getBoundingClientRect().right))")
            assert right <= WIDTH, right
            assert_fits(page, "audit list")
            shot(page, "audit-list")

            # A pool page: one line per endpoint, options on the endpoint's own page.
            page.goto(gateway.url + reverse("admin:workers_workerpool_change", args=[cluster.pool.pk]))
            expect(page.locator("#endpoints-group")).to_be_visible()
            assert page.locator("textarea[name$='-options']").count() == 0
            heights = page.evaluate("[...document.querySelectorAll('#endpoints-group tr.has_original')].map(r => r.getBoundingClientRect().height)")
            assert len(heights) == 2 and max(heights) < 60, heights
            assert_fits(page, "pool page")
            shot(page, "pool")
            page.goto(gateway.url + reverse("admin:workers_workerpool_change", args=[spare.pk]))
            expect(page.locator("#endpoints-group")).to_contain_text("connection refused")
            page.locator("#endpoints-group a.gw-options").click()
            expect(page.locator("textarea[name='options']")).to_contain_text("bootstrap_port")
            assert_fits(page, "endpoint page")
            shot(page, "endpoint")

            # The model routes.
            page.goto(gateway.url + reverse("admin:workers_modelroute_changelist"))
            expect(page.locator("#result_list")).to_contain_text(spare.name)
            assert_fits(page, "model routes")
            shot(page, "model-routes")
            page.goto(gateway.url + reverse("admin:workers_modelroute_change", args=[route.pk]))
            expect(page.locator("#route_pools-group")).to_be_visible()
            assert_fits(page, "model route")
            shot(page, "model-route")

            for name, url in (
                ("pools", reverse("admin:workers_workerpool_changelist")),
                ("endpoints", reverse("admin:workers_workerendpoint_changelist")),
                ("reservations", reverse("admin:workers_reservation_changelist")),
                ("keys", reverse("admin:messages_api_apikey_changelist")),
            ):
                page.goto(gateway.url + url)
                assert_fits(page, name)

            assert not bad_responses, bad_responses
        except Exception:
            for open_page in browser.contexts[0].pages if browser.contexts else []:
                open_page.screenshot(path=str(SCREENSHOTS / "admin-console-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
            connections.close_all()
