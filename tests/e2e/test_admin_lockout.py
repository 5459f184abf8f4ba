"""The admin's login lockout under daphne (a real gateway process): the address that fails
ADMIN_LOGIN_FAILURE_LIMIT times is refused 429, the right password included; a client cannot
escape it with an X-Forwarded-For header; behind a trusted proxy (TRUSTED_PROXIES) the address
locked is the one the proxy forwarded, not the proxy's. And ADMIN_URL moves the admin."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model

from tests.support.gateway import Gateway

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "the-right-password-1"


def login_form(client: httpx.Client, admin: str) -> str:
    page = client.get(f"/{admin}login/")
    assert page.status_code == 200, page.text[:300]
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert match is not None
    return match.group(1)


def login(client: httpx.Client, admin: str, token: str, password: str, forwarded_for: str | None = None) -> int:
    headers = {"referer": f"{client.base_url}/{admin}login/"}
    if forwarded_for is not None:
        headers["x-forwarded-for"] = forwarded_for
    response = client.post(
        f"/{admin}login/",
        data={"csrfmiddlewaretoken": token, "username": "operator", "password": password, "next": f"/{admin}"},
        headers=headers,
    )
    return response.status_code


def test_lockout_of_the_socket_peer(transactional_db: Any, gateways: Callable[..., Gateway]) -> None:
    get_user_model().objects.create_superuser("operator", "", PASSWORD)
    gateway = gateways(ADMIN_LOGIN_FAILURE_LIMIT="3", ADMIN_URL="ops-area/")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        # ADMIN_URL moved the admin: the old path is not it.
        assert client.get("/admin/login/").status_code == 404
        token = login_form(client, "ops-area/")
        assert [login(client, "ops-area/", token, f"wrong-{i}") for i in range(3)] == [200, 200, 429]
        # Locked out: the right password too, and an X-Forwarded-For header changes nothing
        # (no trusted proxy is configured, so the socket peer is the client). Each refusal comes
        # ADMIN_LOGIN_LOCKOUT_DELAY_S (1 s) late.
        started = time.monotonic()
        assert login(client, "ops-area/", token, PASSWORD) == 429
        assert time.monotonic() - started >= 0.9
        assert login(client, "ops-area/", token, PASSWORD, forwarded_for="198.51.100.77") == 429


def test_lockout_behind_a_trusted_proxy(transactional_db: Any, gateways: Callable[..., Gateway]) -> None:
    get_user_model().objects.create_superuser("operator", "", PASSWORD)
    gateway = gateways(ADMIN_LOGIN_FAILURE_LIMIT="3", TRUSTED_PROXIES="127.0.0.1")
    with httpx.Client(base_url=gateway.url, timeout=30) as attacker, httpx.Client(base_url=gateway.url, timeout=30) as operator:
        token = login_form(attacker, "admin/")
        # What the proxy appended is the client; what the client wrote before it is not.
        statuses = [login(attacker, "admin/", token, f"wrong-{i}", forwarded_for=f"10.{i}.0.1, 198.51.100.1") for i in range(3)]
        assert statuses == [200, 200, 429]
        assert login(attacker, "admin/", token, PASSWORD, forwarded_for="198.51.100.1") == 429
        # The proxy's own address is not locked: another client behind it logs in.
        operator_token = login_form(operator, "admin/")
        assert login(operator, "admin/", operator_token, PASSWORD, forwarded_for="198.51.100.2") == 302


def test_logins_sent_at_once_are_counted_one_at_a_time(transactional_db: Any, gateways: Callable[..., Gateway]) -> None:
    """Django runs each request's view on a thread of its own under ASGI, and axes checks the count
    before the password: twenty wrong logins sent at once would all be checked (and hashed) before
    the first failure was recorded. Taken one at a time per address, exactly the limit are."""
    from axes.models import AccessAttempt

    get_user_model().objects.create_superuser("operator", "", PASSWORD)
    gateway = gateways(ADMIN_LOGIN_FAILURE_LIMIT="3", ADMIN_LOGIN_LOCKOUT_DELAY_S="0.1")
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        token = login_form(client, "admin/")
        cookies = dict(client.cookies)

    def attempt(i: int) -> int:
        with httpx.Client(base_url=gateway.url, timeout=60, cookies=cookies) as one:
            return login(one, "admin/", token, f"wrong-{i}")

    with ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(attempt, range(20)))
    assert sorted(statuses) == [200] * 2 + [429] * 18, statuses
    assert [a.failures_since_start for a in AccessAttempt.objects.all()] == [3]
