"""Production settings: load-balancer probes by IP, the HTTPS settings from the environment, and a
clean `check --deploy` — against a real daphne and a real `manage.py` process."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import PROJECT_ROOT, Gateway

DB = pytest.mark.django_db(transaction=True)

PRODUCTION_ENV = {
    "SECURE_HSTS_SECONDS": "31536000",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": "1",
    "SECURE_HSTS_PRELOAD": "1",
    "SECURE_SSL_REDIRECT": "1",
    "SESSION_COOKIE_SECURE": "1",
    "CSRF_COOKIE_SECURE": "1",
    "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https",
}


def check_deploy(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SECURE_", "SESSION_", "CSRF_", "DEBUG"))}
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=PROJECT_ROOT,
        env={
            **base,
            "DJANGO_SETTINGS_MODULE": "disagg_project.settings",
            "SECRET_KEY": secrets.token_urlsafe(50),
            "ALLOWED_HOSTS": "gateway.example.com",
            "DATABASE_URL": f"sqlite:///{tmp_path / 'check.sqlite3'}",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_with_the_production_environment(tmp_path: Path) -> None:
    result = check_deploy(tmp_path, **PRODUCTION_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_check_deploy_names_what_the_defaults_leave_open(tmp_path: Path) -> None:
    """The defaults serve `make run` over plain HTTP: exactly the HTTPS warnings, which the
    environment above clears."""
    result = check_deploy(tmp_path)
    assert result.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in result.stderr + result.stdout


def test_a_malformed_proxy_header_setting_is_refused(tmp_path: Path) -> None:
    result = check_deploy(tmp_path, **{**PRODUCTION_ENV, "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO"})
    assert result.returncode != 0 and "SECURE_PROXY_SSL_HEADER must look like" in result.stderr


# --- probes by IP -------------------------------------------------------------------------------------


@DB
@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
@pytest.mark.parametrize("host", ["10.20.30.40", "10.20.30.40:8000", "[fd00::1]:8000", "lb-probe.internal"])
def test_probes_answer_any_host(gateway: Gateway, path: str, host: str) -> None:
    response = httpx.get(gateway.url + path, headers={"host": host}, timeout=10)
    # /ready may be 503 (no pool in this test); what matters is that it is not the host check's 400.
    assert response.status_code in (200, 503), response.text
    if path != "/metrics":
        assert response.json()["status"] in ("ok", "ready", "not ready")


@DB
@pytest.mark.parametrize("path", ["/admin/login/", "/", "/no-such-page"])
def test_the_rest_of_the_site_keeps_the_host_check(gateway: Gateway, path: str) -> None:
    assert httpx.get(gateway.url + path, headers={"host": "10.20.30.40"}, timeout=10).status_code == 400
    assert httpx.get(gateway.url + path, timeout=10).status_code in (200, 302, 404)


@DB
def test_https_redirect_spares_probes_and_the_api(gateways: Callable[..., Gateway]) -> None:
    gateway = gateways(**PRODUCTION_ENV)
    with httpx.Client(timeout=10, follow_redirects=False) as client:
        # The admin over plain HTTP is sent to HTTPS, with HSTS once it is there.
        admin = client.get(gateway.url + "/admin/login/")
        assert admin.status_code == 301 and admin.headers["location"].startswith("https://")
        behind_proxy = client.get(gateway.url + "/admin/login/", headers={"x-forwarded-proto": "https"})
        assert behind_proxy.status_code == 200
        assert behind_proxy.headers["strict-transport-security"] == "max-age=31536000; includeSubDomains; preload"
        assert "secure" in behind_proxy.headers["set-cookie"].lower()  # the CSRF cookie
        # Probes (by IP, plain HTTP) and the root probe are answered, not redirected.
        for path in ("/health", "/ready"):
            assert client.get(gateway.url + path, headers={"host": "10.20.30.40"}).status_code in (200, 503)
        assert client.head(gateway.url + "/").status_code == 200
        # The API is the consumers', which no Django middleware sees: never redirected.
        api = client.post(gateway.url + "/v1/messages", json={}, headers={"anthropic-version": "2023-06-01"})
        assert api.status_code == 401 and api.json()["error"]["type"] == "authentication_error"
