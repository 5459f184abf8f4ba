"""Every refused request is answered in Anthropic's envelope and leaves exactly one audit row, the
same way on every route — except requests without a valid key, which are all counted in a metric
but only sampled into the audit, and those the HTTP intake guard refuses before any application
runs (over-size bodies, slow uploads, malformed HTTP), which are counted in their own metric. Real daphne, real database."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.cluster import audit_row, wait_until
from tests.support.gateway import Gateway
from tests.support.prometheus import metric_value

pytestmark = pytest.mark.django_db(transaction=True)

JSON = {"anthropic-version": "2023-06-01", "content-type": "application/json"}
MESSAGE = {"model": "no-such-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def key(transactional_db: Any) -> str:
    from messages_api.auth import create_api_key

    _, key = create_api_key(f"rejections-{time.monotonic_ns()}")
    return key


CASES = [
    # method, path, body, status, error type
    ("GET", "/v1/messages", None, 405, "invalid_request_error"),
    ("POST", "/v1/models", None, 405, "invalid_request_error"),
    ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error"),
    ("POST", "/v1/messages", MESSAGE, 404, "not_found_error"),
    ("POST", "/v1/messages/count_tokens", {"model": "no-such-model", "messages": MESSAGE["messages"]}, 404, "not_found_error"),
    ("GET", "/v1/models/no-such-model", None, 404, "not_found_error"),
]


@pytest.mark.parametrize("method,path,body,status,error_type", CASES, ids=[f"{c[3]}-{c[0]}-{c[1]}" for c in CASES])
def test_a_rejection_writes_one_row(gateway: Gateway, key: str, method: str, path: str, body: Any, status: int, error_type: str) -> None:
    from messages_api.models import MessageRequest

    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    response = httpx.request(method, gateway.url + path, headers={**JSON, "x-api-key": key}, timeout=10, **kwargs)
    assert response.status_code == status, response.text
    answer = response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == error_type
    request_id = response.headers["request-id"]
    assert answer["request_id"] == request_id
    if status == 405:
        assert response.headers["allow"] in ("POST", "GET")
    row = audit_row(request_id)
    assert row.status == "rejected" and row.http_status == status and row.error_type == error_type
    assert row.error_message == answer["error"]["message"]
    assert row.route == f"{method} {path}"
    assert row.api_key_name.startswith("rejections-")  # attributed even when refused before auth
    assert MessageRequest.objects.filter(request_id=request_id).count() == 1


def test_a_body_over_the_limit_is_refused_before_the_application_and_counted(gateways: Callable[..., Gateway], key: str) -> None:
    """The intake guard refuses it while daphne parses the headers (no body buffered, no key looked
    up), so like any anonymous refusal it is counted in a metric, not written as a row."""
    from messages_api.models import MessageRequest

    small = gateways(MESSAGES_MAX_BODY_BYTES="1000")

    def refused() -> float:
        text = httpx.get(small.url + "/metrics", timeout=5).text
        try:
            return metric_value(text, "gateway_http_refused_total", status="413")
        except AssertionError:
            return 0.0

    before = refused()
    response = httpx.post(small.url + "/v1/messages", headers={**JSON, "x-api-key": key}, content=b"x" * 5000, timeout=10)
    assert response.status_code == 413
    answer = response.json()
    assert answer["error"]["type"] == "request_too_large"
    assert answer["request_id"] == response.headers["request-id"]
    assert refused() == before + 1
    assert not MessageRequest.objects.filter(request_id=response.headers["request-id"]).exists()


def unauthenticated_count(gateway: Gateway) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    try:
        return metric_value(text, "gateway_unauthenticated_rejections_total")
    except AssertionError:
        return 0.0


def test_unauthenticated_rejections_are_counted_and_sampled(gateway: Gateway, key: str) -> None:
    from messages_api.models import MessageRequest

    before = unauthenticated_count(gateway)
    started = time.monotonic()
    ids = []
    with httpx.Client(timeout=10) as client:
        for i in range(40):
            # No key, a wrong key, and a wrong method without a key: all anonymous refusals.
            if i % 3 == 0:
                response = client.post(gateway.url + "/v1/messages", headers=JSON, json=MESSAGE)
            elif i % 3 == 1:
                response = client.post(gateway.url + "/v1/messages", headers={**JSON, "x-api-key": "sk-gw-wrong"}, json=MESSAGE)
            else:
                response = client.get(gateway.url + "/v1/messages", headers=JSON)
            assert response.status_code in (401, 405) and response.json()["type"] == "error"
            ids.append(response.headers["request-id"])
    elapsed = time.monotonic() - started
    # Every refusal is counted...
    assert unauthenticated_count(gateway) - before == 40
    # ...but at most one row per second (default AUDIT_UNAUTHENTICATED_SAMPLE_PER_S=1) is written.
    # An attributed rejection afterwards is always written; the writer keeps order, so once it is
    # in the database the sampled rows before it are too.
    marker = httpx.post(gateway.url + "/v1/messages", headers={**JSON, "x-api-key": key}, json=MESSAGE, timeout=10)
    audit_row(marker.headers["request-id"])
    written = MessageRequest.objects.filter(request_id__in=ids)
    # (The lower bound is not 1: a refusal just before this test may have taken this second's sample.)
    assert written.count() <= elapsed + 2 and written.count() < 40, (written.count(), elapsed)
    assert all(row.status == "rejected" and row.api_key_name == "" for row in written)

    # A later sample says how many it stands for.
    def sampled_with_count() -> Any:
        response = httpx.post(gateway.url + "/v1/messages", headers=JSON, json=MESSAGE, timeout=10)
        row = MessageRequest.objects.filter(request_id=response.headers["request-id"]).first()
        if row is None:
            marker = httpx.post(gateway.url + "/v1/messages", headers={**JSON, "x-api-key": key}, json=MESSAGE, timeout=10)
            audit_row(marker.headers["request-id"])
            row = MessageRequest.objects.filter(request_id=response.headers["request-id"]).first()
        return row if row is not None and "more unauthenticated rejections not recorded" in row.error_message else None

    wait_until(sampled_with_count, timeout=5, interval=0.2, message="no sampled row says how many it stands for")
