"""Unknown API paths answer Anthropic's 404 envelope, through a real daphne (messages_api.routes)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.gateway import Gateway


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1"), ("GET", "/v1/"), ("POST", "/v1/messages/batches"), ("GET", "/v1/files"), ("POST", "/v1/complete"),
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


def test_other_paths_are_still_django_s(gateway: Gateway) -> None:
    assert httpx.get(gateway.url + "/v1x", timeout=10).headers["content-type"].startswith("text/html")
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
