"""The admin's Message Batches page in headless Chromium against the real daphne gateway: a batch's
owner, progress and expiry, its link to the items' audit rows, and the cancel action.

Needs Debian's `chromium` (/usr/bin/chromium) and the `playwright` Python package, as
tests/e2e/test_admin_browser.py; skipped without them.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, SCREENSHOTS, logged_in_page
from tests.support.cluster import register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)


def test_batches_page_in_a_browser(
    transactional_db: Any, gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # playwright's sync API runs an event loop on this thread; this test's ORM calls are sync code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from django.contrib.auth import get_user_model
    from playwright.sync_api import expect, sync_playwright

    from messages_api.models import MessageBatch
    from tests.support.sdk import sdk_client

    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    # The suite's shared gateway runs no batch runner: the batch stays in progress, queued.
    with sdk_client(gateway.url, cluster.key) as client:
        batch = client.messages.batches.create(
            requests=[  # type: ignore[misc]
                {"custom_id": f"i{n}", "params": {"model": cluster.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}}
                for n in range(3)
            ]
        )
    password = "operator-password-1"
    get_user_model().objects.create_superuser("batch-operator", "batch-operator@example.com", password)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    admin = gateway.url + "/admin/"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page, bad_responses = logged_in_page(browser, admin, "batch-operator", password, viewport={"width": 1400, "height": 900})
            page.goto(admin + "messages_api/messagebatch/")
            result_list = page.locator("#result_list")
            expect(result_list).to_contain_text(batch.id)
            expect(result_list).to_contain_text("queued 3")
            expect(page.locator(f"#result_list a[href*='batch_id={batch.id}']")).to_have_count(1)
            page.screenshot(path=str(SCREENSHOTS / "admin-batches.png"), full_page=True)

            pk = MessageBatch.objects.get(batch_id=batch.id).pk
            page.check(f"input[name='_selected_action'][value='{pk}']")
            page.select_option("select[name='action']", "cancel_batches")
            with page.expect_navigation():  # the action's POST has returned: its writes are committed
                page.click("#changelist-form button[name='index']")
            expect(page.locator("ul.messagelist li.success")).to_contain_text("Cancellation started for 1 batch(es).")
            ended = MessageBatch.objects.get(pk=pk)
            assert ended.processing_status == "ended" and ended.canceled == 3
            expect(page.locator("#result_list")).to_contain_text("canceled 3")

            page.click(f"#result_list a[href*='batch_id={batch.id}']")
            expect(page.locator("#content h1")).to_be_visible()
            assert bad_responses == []
        finally:
            browser.close()
