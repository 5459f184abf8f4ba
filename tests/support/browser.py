"""The admin in a real browser: a page logged in as a staff user, recording every answer ≥ 400."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Browser, Page, expect


def logged_in_page(
    browser: Browser, admin_url: str, username: str, password: str, *, timeout_ms: int = 10_000, **page_options: Any
) -> tuple[Page, list[str]]:
    """A new page of `browser` logged in at `admin_url` (ending in "/"), and the list the page's
    failed answers ("status url") are appended to."""
    page = browser.new_page(**page_options)
    page.set_default_timeout(timeout_ms)
    bad_responses: list[str] = []
    page.on("response", lambda r: bad_responses.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(admin_url + "login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text(username)
    return page, bad_responses
