"""The operators' admin end to end: headless Chromium (playwright) against the real daphne gateway.

Needs Debian's `chromium` (/usr/bin/chromium) and the `playwright` Python package; playwright's
own browser downloads are not used. Screenshots go to .gateway/screenshots/.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, SCREENSHOTS, logged_in_page, send
from tests.support.cluster import audit_row, register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker

NEW_ENDPOINT_URL = "http://127.0.0.1:9/"  # discard port: nothing answers there

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)


def test_operator_admin_in_a_browser(
    transactional_db: Any,
    gateway: Gateway,
    context_worker: SimWorker,
    generation_worker: SimWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # playwright's sync API runs its event loop on this thread (in a greenlet), so Django sees a
    # running loop and refuses ORM calls; this test's ORM calls are plain sync code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    # Imported here: without the package this one test fails, the rest of the suite still runs.
    from django.contrib.auth import get_user_model
    from django.db import connections
    from playwright.sync_api import expect, sync_playwright

    from messages_api.auth import hash_key
    from messages_api.models import ApiKey
    from workers.models import WorkerEndpoint

    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    pool = cluster.pool

    # Traffic first, while the pool holds only the two sim workers (the endpoint added below
    # points at nothing and must never be routed to).
    failed = send(gateway, cluster.headers(), cluster.model, "hi [sim context_status=503]")
    assert failed.status_code == 503, failed.text
    failed_id = failed.headers["request-id"]
    completed = send(gateway, cluster.headers(), cluster.model, "hello [sim tokens=3]")
    assert completed.status_code == 200, completed.text
    completed_id = completed.headers["request-id"]
    failed_row = audit_row(failed_id)
    assert failed_row.status == "failed" and failed_row.error_message
    assert audit_row(completed_id).status == "completed"

    # The admin's static files are served under daphne (whitenoise, no collectstatic).
    css = httpx.get(gateway.url + "/static/admin/css/base.css", timeout=5)
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")

    password = "operator-password-1"
    get_user_model().objects.create_superuser("operator", "operator@example.com", password)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    admin = gateway.url + "/admin/"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page, bad_responses = logged_in_page(browser, admin, "operator", password, viewport={"width": 1400, "height": 900})
            # The stylesheet was loaded and applied, not just reachable.
            assert page.evaluate(
                "[...document.styleSheets].some(s => (s.href || '').endsWith('/admin/css/base.css') && s.cssRules.length > 0)"
            )

            # The pool page: add a generation endpoint in the inline.
            page.goto(f"{admin}workers/workerpool/{pool.pk}/change/")
            expect(page.locator("#endpoints-group")).to_be_visible()
            page.click("#endpoints-group .add-row a")
            new_row = "#endpoints-2"
            expect(page.locator(new_row)).to_be_visible()
            page.select_option(f"{new_row} select[name='endpoints-2-role']", "generation")
            page.fill(f"{new_row} input[name='endpoints-2-url']", NEW_ENDPOINT_URL)
            page.click("input[name='_continue']")
            expect(page.locator("ul.messagelist li.success")).to_contain_text("was changed successfully")
            endpoint = WorkerEndpoint.objects.get(pool=pool, url=NEW_ENDPOINT_URL)
            assert endpoint.role == "generation" and endpoint.enabled and not endpoint.draining
            assert pool.endpoints.count() == 3
            # The change is in the admin's history: who, and what (the endpoint added in the inline).
            from django.contrib.admin.models import LogEntry

            entry = LogEntry.objects.filter(object_id=str(pool.pk), content_type__model="workerpool").latest("action_time")
            assert entry.user.get_username() == "operator" and "Added worker endpoint" in entry.get_change_message()
            page.screenshot(path=str(SCREENSHOTS / "admin-pool.png"), full_page=True)

            # The endpoint changelist: drain the new endpoint with the action.
            page.goto(admin + "workers/workerendpoint/")
            page.check(f"input[name='_selected_action'][value='{endpoint.pk}']")
            page.select_option("select[name='action']", "drain")
            with page.expect_navigation():  # the action's POST has returned: its writes are committed
                page.click("#changelist-form button[name='index']")
            endpoint.refresh_from_db()
            assert endpoint.draining and endpoint.enabled
            assert not WorkerEndpoint.objects.filter(pool=pool, draining=True).exclude(pk=endpoint.pk).exists()

            # The audit: filter to failed requests.
            page.goto(admin + "messages_api/messagerequest/")
            expect(page.locator("#result_list")).to_contain_text(completed_id)
            page.click("#changelist-filter a[href*='status__exact=failed']")
            page.wait_for_url(re.compile(r"status__exact=failed"))
            rows = page.locator("#result_list tbody tr")
            expect(rows).to_have_count(1)
            expect(rows.first).to_contain_text(failed_id)
            expect(page.locator("#result_list")).not_to_contain_text(completed_id)
            page.screenshot(path=str(SCREENSHOTS / "admin-failed-requests.png"), full_page=True)

            # Its detail page shows the error.
            rows.first.locator("a", has_text=failed_id).click()
            expect(page.locator(".field-request_id")).to_contain_text(failed_id)
            expect(page.locator(".field-status")).to_contain_text("failed")
            expect(page.locator(".field-error_message")).to_contain_text(failed_row.error_message.strip()[:200])

            # A new API key: shown once on the page after saving, stored only as its hash.
            page.goto(admin + "messages_api/apikey/add/")
            page.fill("#id_name", "browser-made-key")
            page.click("input[name='_save']")
            shown_key = page.locator("#new-api-key")
            expect(shown_key).to_contain_text("sk-gw2-")
            shown = re.search(r"sk-gw2-[A-Za-z0-9]+", shown_key.inner_text())
            assert shown, shown_key.inner_text()
            # Shown straight in the response: not passed through the messages cookie or session.
            assert not any("sk-gw" in c["value"] for c in page.context.cookies())
            key = shown.group(0)
            api_key = ApiKey.objects.get(name="browser-made-key")
            assert api_key.key_hash == hash_key(key) and key.startswith(api_key.prefix)
            for field in ApiKey._meta.concrete_fields:
                assert key not in str(field.value_from_object(api_key)), f"the key is stored in {field.name}"

            assert not bad_responses, bad_responses
        except Exception:
            for open_page in browser.contexts[0].pages if browser.contexts else []:
                open_page.screenshot(path=str(SCREENSHOTS / "admin-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
            # The ORM calls above ran in playwright's greenlet, whose context holds a connection
            # of its own: close it here, or PostgreSQL cannot drop the test database at the end.
            connections.close_all()


def test_key_usage_page_in_a_browser(
    transactional_db: Any,
    gateways: Any,
    context_worker: SimWorker,
    generation_worker: SimWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key's usage page: requests through a real gateway are counted in their hour, the page
    charts them with rows made here in SVG, fits a 1440 px screen, and downloads its CSV."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # as above: playwright's loop on this thread
    from datetime import datetime, timedelta, timezone

    from django.contrib.auth import get_user_model
    from django.db import connections
    from playwright.sync_api import expect, sync_playwright

    from messages_api.auth import hash_key
    from messages_api.models import ApiKey, KeyUsage
    from tests.support.cluster import wait_until

    gateway = gateways()
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    api_key = ApiKey.objects.get(key_hash=hash_key(cluster.key))

    # Counted by the gateway itself: one failed and one completed request.
    assert send(gateway, cluster.headers(), cluster.model, "hi [sim context_status=503]").status_code == 503
    assert send(gateway, cluster.headers(), cluster.model, "hello [sim tokens=3]").status_code == 200
    counted = wait_until(
        lambda: sum(KeyUsage.objects.filter(api_key=api_key).values_list("requests", flat=True)) == 2,
        message="the gateway did not write the key's usage",
    )
    assert counted
    recent = list(KeyUsage.objects.filter(api_key=api_key))
    assert sum(r.output_tokens for r in recent) == 3 and sum(sum(r.errors.values()) for r in recent) == 1

    # Older hours, as if counted earlier.
    this_hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    KeyUsage.objects.create(api_key=api_key, hour=this_hour - timedelta(hours=5), requests=37, input_tokens=12345,
                            output_tokens=678, cache_read_tokens=9000, queued_ms_total=370.0, errors={"overloaded_error": 4})  # fmt: skip
    KeyUsage.objects.create(api_key=api_key, hour=this_hour - timedelta(days=3), requests=41, output_tokens=4100)

    password = "operator-password-1"
    get_user_model().objects.create_superuser("operator", "operator@example.com", password)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    admin = gateway.url + "/admin/"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page, bad_responses = logged_in_page(
                browser, admin, "operator", password, viewport={"width": 1440, "height": 900}, accept_downloads=True
            )

            # From the key's change page to its usage.
            page.goto(f"{admin}messages_api/apikey/{api_key.pk}/change/")
            page.click("#key-usage-link")
            page.wait_for_url(re.compile(rf"/apikey/{api_key.pk}/usage/$"))
            charts = page.locator("svg.usage-chart")
            expect(charts).to_have_count(6)
            hours, days = page.locator("#usage-hours"), page.locator("#usage-days")
            expect(hours.locator('rect.point[data-series="requests"][data-value="37"]')).to_have_count(1)
            expect(hours.locator('circle.point[data-series="input"][data-value="12345"]')).to_have_count(1)
            expect(hours.locator('circle.point[data-series="cache read"][data-value="9000"]')).to_have_count(1)
            expect(hours.locator('rect.point[data-series="errors"][data-value="4"]')).to_have_count(1)
            expect(hours.locator('rect.point[data-series="ms queued per request"][data-value="10"]')).to_have_count(1)
            expect(days.locator('rect.point[data-series="requests"][data-value="41"]')).to_have_count(1)
            expect(hours.locator(".usage-errors")).to_contain_text("overloaded_error")
            # Drawn, at a readable size, and nothing wider than the screen.
            for i in range(6):
                box = charts.nth(i).bounding_box()
                assert box is not None and box["width"] > 400 and box["height"] > 150, box
            tallest = page.evaluate(
                "Math.max(...[...document.querySelectorAll('#usage-hours rect.point[data-series=requests]')]"
                ".map(r => r.getBoundingClientRect().height))"
            )
            assert tallest > 50  # the 37-request hour is drawn as a bar, not a hairline
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), page.evaluate(
                "[document.documentElement.scrollWidth, window.innerWidth]"
            )
            page.screenshot(path=str(SCREENSHOTS / "admin-key-usage.png"), full_page=True)

            # Download CSV: the 30 days, one line a day, the last being today.
            with page.expect_download() as download_info:
                days.locator("a.usage-csv").click()
            download = download_info.value
            lines = Path(download.path()).read_text().splitlines()
            assert lines[0].startswith("start_utc,requests,input_tokens,output_tokens,cache_read_tokens,errors,")
            assert len(lines) == 31 and lines[-1].startswith(this_hour.strftime("%Y-%m-%dT00:00:00Z,"))
            assert sum(int(line.split(",")[1]) for line in lines[1:]) == 2 + 37 + 41
            assert download.suggested_filename.endswith("-days.csv")

            assert not bad_responses, bad_responses
        except Exception:
            for open_page in browser.contexts[0].pages if browser.contexts else []:
                open_page.screenshot(path=str(SCREENSHOTS / "admin-key-usage-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
            connections.close_all()
