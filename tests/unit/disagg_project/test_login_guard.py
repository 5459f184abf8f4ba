"""The admin's login lockout (django-axes and disagg_project/login_guard.py), in process: after
ADMIN_LOGIN_FAILURE_LIMIT failed logins from one address that address is refused with 429, even
with the right password, and a refused login hashes no password. (The client address it locks:
tests/unit/disagg_project/test_client_address.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.test import Client

from disagg_project import login_guard

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "the-right-password-1"
LOGIN = "/" + settings.ADMIN_URL + "login/"


@pytest.fixture
def operator() -> Any:
    return get_user_model().objects.create_superuser("operator", "", PASSWORD)


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every PBKDF2 computation (checking a password, or the dummy one for an unknown user)."""
    seen: list[str] = []
    real = PBKDF2PasswordHasher.encode

    def counting(self: PBKDF2PasswordHasher, password: str, salt: str, iterations: int | None = None) -> str:
        seen.append(salt)
        return real(self, password, salt, iterations)

    monkeypatch.setattr(PBKDF2PasswordHasher, "encode", counting)
    yield seen


@pytest.fixture(autouse=True)
def no_delay(settings: Any) -> None:
    settings.ADMIN_LOGIN_LOCKOUT_DELAY_S = 0.0  # the refusals' delay is the e2e test's


@pytest.fixture(autouse=True)
def fresh_memory() -> Iterator[None]:
    # The clients remembered as locked out are the process's: none from another test.
    login_guard._locked.clear()
    yield
    login_guard._locked.clear()


def login(client: Client, password: str, **extra: str) -> Any:
    return client.post(LOGIN, {"username": "operator", "password": password, "next": "/" + settings.ADMIN_URL}, **extra)


def test_the_right_password_is_refused_once_the_address_is_locked_out(operator: Any, hashes: list[str]) -> None:
    client = Client(HTTP_HOST="127.0.0.1")
    limit = settings.AXES_FAILURE_LIMIT
    for attempt in range(limit - 1):
        assert login(client, f"wrong-{attempt}").status_code == 200  # the form again
    assert login(client, "wrong-last").status_code == 429  # the failure that reaches the limit
    hashed_before = len(hashes)

    for _ in range(20):
        refused = login(client, "wrong")
        assert refused.status_code == 429
    refused = login(client, PASSWORD)
    assert refused.status_code == 429, "a locked-out address logged in with the right password"
    assert "_auth_user_id" not in client.session
    # Refusals are cheap: no password was hashed for any of them.
    assert len(hashes) == hashed_before

    # Another address is not locked out.
    other = Client(HTTP_HOST="127.0.0.1", REMOTE_ADDR="192.0.2.7")
    assert login(other, PASSWORD).status_code == 302


def test_a_success_before_the_limit_resets_the_count(operator: Any) -> None:
    client = Client(HTTP_HOST="127.0.0.1")
    for attempt in range(settings.AXES_FAILURE_LIMIT - 1):
        assert login(client, f"wrong-{attempt}").status_code == 200
    assert login(client, PASSWORD).status_code == 302
    client.logout()
    for attempt in range(settings.AXES_FAILURE_LIMIT - 1):
        assert login(client, f"wrong-again-{attempt}").status_code == 200


def test_the_lockout_backend_comes_before_the_password_check() -> None:
    # The order that keeps a locked-out login from reaching the hasher.
    assert settings.AUTHENTICATION_BACKENDS[0] == "axes.backends.AxesStandaloneBackend"
    assert settings.MIDDLEWARE[-1] == "axes.middleware.AxesMiddleware"
    guard = settings.MIDDLEWARE.index("disagg_project.login_guard.LoginLockoutMiddleware")
    assert guard < settings.MIDDLEWARE.index("django.contrib.sessions.middleware.SessionMiddleware")
    assert guard < settings.MIDDLEWARE.index("django.middleware.csrf.CsrfViewMiddleware")
