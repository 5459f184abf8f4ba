"""Non-streamed `POST /v1/messages` end to end: real daphne, real sim workers, the database."""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import Cluster, audit_row, reservations_closed
from tests.support.gateway import Gateway


def post(gateway: Gateway, cluster: Cluster, text: str, **body: object) -> httpx.Response:
    payload = {"model": cluster.model, "max_tokens": 64, "messages": [{"role": "user", "content": text}], **body}
    return httpx.post(gateway.url + "/v1/messages", json=payload, headers=cluster.headers(), timeout=30)


def test_message_through_the_pair(gateway: Gateway, cluster: Cluster) -> None:
    response = post(gateway, cluster, "Hello there [sim tokens=5]")
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_")
    assert message["stop_reason"] == "end_turn"
    assert message["content"][0]["type"] == "text" and message["content"][0]["text"]
    assert message["usage"]["output_tokens"] == 5
    assert message["usage"]["input_tokens"] > 0
    request_id = response.headers["request-id"]
    row = audit_row(request_id)
    assert row.status == "completed" and row.http_status == 200 and row.stage == "done"
    assert row.context_endpoint == cluster.context.url and row.generation_endpoint == cluster.generation.url
    assert row.output_tokens == 5
    rows = reservations_closed(request_id)
    assert sorted(r.stage for r in rows) == ["context", "generation"]
    assert {r.outcome for r in rows} == {"success"}
    assert cluster.context.stats()["kv_held"] == 0


@pytest.mark.parametrize(
    "status,error_type", [(503, "overloaded_error"), (429, "rate_limit_error"), (500, "api_error"), (400, "invalid_request_error")]
)
def test_context_failure_keeps_status(gateway: Gateway, cluster: Cluster, status: int, error_type: str) -> None:
    response = post(gateway, cluster, f"hi [sim context_status={status}]")
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type
    assert body["request_id"] == response.headers["request-id"]
    assert cluster.context.url not in response.text and "127.0.0.1" not in response.text
    row = audit_row(body["request_id"])
    assert row.status == "failed" and row.http_status == status and row.stage == "context"
    rows = reservations_closed(body["request_id"])
    assert all(r.outcome == "failure" for r in rows)
