"""Unknown API paths answer Anthropic's 404 envelope, through a real daphne (messages_api.routes), and so
does every other request target Django does not serve (its handler404, messages_api.views)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.conversation import exchange
from tests.support.gateway import Gateway


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1"), ("GET", "/v1/"), ("POST", "/v1/messages/batches/msgbatch_x/other"), ("GET", "/v1/files"), ("POST", "/v1/complete"),
     ("GET", "/v1/models/a/b"), ("POST", "/v1/messages/")],
)
def test_an_unknown_api_path_is_a_404_in_the_envelope(gateway: Gateway, method: str, path: str) -> None:
    response = httpx.request(method, gateway.url + path, json={}, timeout=10)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["type"] == "error"
    assert body["error"] == {"type": "not_found_error", "message": f"Not found: {method} {path}"}
    assert body["request_id"] == response.headers["request-id"]


@pytest.mark.parametrize(
    ("request_line", "path"),
    [
        ("OPTIONS * HTTP/1.1", "*"),
        ("POST /V1/MESSAGES HTTP/1.1", "/V1/MESSAGES"),
        ("GET /..%2f..%2fetc/passwd HTTP/1.1", "/../../etc/passwd"),
        ("GET http://example.com/v1/models HTTP/1.1", "http://example.com/v1/models"),
        ("GET /v1x HTTP/1.1", "/v1x"),
        ("GET /nothing/here HTTP/1.1", "/nothing/here"),
    ],
    ids=["asterisk", "upper-case", "dot-dot", "absolute-form", "v1x", "other"],
)
def test_every_other_request_target_is_a_404_in_the_envelope(gateway: Gateway, request_line: str, path: str) -> None:
    """Django's own 404 page was HTML; every target it does not serve now answers as the API does."""
    answer = exchange(gateway, f"{request_line}\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n\r\n".encode(), wait_close=0)
    assert answer.status == 404
    assert answer.envelope() == {"type": "not_found_error", "message": f"Not found: {request_line.split()[0]} {path}"}


def test_django_s_pages_are_still_django_s(gateway: Gateway) -> None:
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
    login = httpx.get(gateway.url + "/admin/login/", timeout=10)
    assert login.status_code == 200 and login.headers["content-type"].startswith("text/html")
