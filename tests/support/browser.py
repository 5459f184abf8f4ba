"""The admin in a real browser: Debian's Chromium and its options, where screenshots go, a page
logged in as a staff user (recording every answer ≥ 400), and `send`, a request for the pages to show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Browser, Page, expect

from tests.support.gateway import PROJECT_ROOT, Gateway

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
SCREENSHOTS = PROJECT_ROOT / ".gateway" / "screenshots"


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


def send(gateway: Gateway, headers: dict[str, str], model: str, text: str) -> httpx.Response:
    payload = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    return httpx.post(gateway.url + "/v1/messages", json=payload, headers=headers, timeout=30)
