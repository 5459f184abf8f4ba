"""Many tenants on one cluster, against real daphne gateways, real sim workers and a real Redis:
per-key limits (429 with Anthropic's headers), endpoint capacity and the admission queue (a
queued stream pings, then gets its slot; an expired wait is a 529; a client leaving frees its
place), limits and capacity held across two gateway processes through Redis, and the fallback
when Redis is gone."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from django.core.management import call_command

from messages_api.auth import hash_key
from messages_api.models import ApiKey
from tests.support.cluster import Cluster, audit_row, register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.prometheus import metric_value
from tests.support.rawclient import RawStream
from tests.support.redis import redis_url_or_skip
from tests.support.simworkers import SimWorker

QUEUE_ENV = {"ADMISSION_QUEUE_TIMEOUT_S": "8"}
# Holds a generation slot for about this long (the sim waits before its first token).
HOLD = "[sim gen_delay=2 tokens=3]"


@pytest.fixture
def make_cluster(transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker) -> Callable[..., Cluster]:
    def make(*gateways: Gateway, **kw: Any) -> Cluster:
        cluster = register_cluster(context_worker, generation_worker, **kw)
        for gateway in gateways:
            wait_registered(gateway, cluster)
        return cluster

    return make


def body(cluster: Cluster, text: str, *, stream: bool = False, max_tokens: int = 64) -> dict[str, Any]:
    return {"model": cluster.model, "max_tokens": max_tokens, "stream": stream, "messages": [{"role": "user", "content": text}]}


def post(gateway: Gateway, cluster: Cluster, text: str, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/messages", json=body(cluster, text, **kw), headers=headers or cluster.headers(), timeout=30)


def limit_key(cluster: Cluster, **limits: Any) -> None:
    """Give the cluster's key limits (through the management command, as an operator would)."""
    name = ApiKey.objects.get(key_hash__isnull=False, name__startswith="test-key-", key_hash=hash_key(cluster.key)).name
    call_command("key_limits", name, **limits)


def start_stream(gateway: Gateway, cluster: Cluster, text: str) -> RawStream:
    return RawStream.post_json(gateway.url + "/v1/messages", body(cluster, text, stream=True), cluster.headers())


def request_ids(response_headers: dict[str, str]) -> str:
    return response_headers["request-id"]


# --- per-key limits --------------------------------------------------------------------------------


def test_a_key_over_its_request_rate_gets_429_with_anthropics_headers(gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(gateway)
    limit_key(cluster, requests_per_minute=2, input_tokens_per_minute=100000)
    for remaining in ("1", "0"):
        ok = post(gateway, cluster, "hello [sim tokens=2]")
        assert ok.status_code == 200, ok.text
        assert ok.headers["anthropic-ratelimit-requests-limit"] == "2"
        assert ok.headers["anthropic-ratelimit-requests-remaining"] == remaining
        assert ok.headers["anthropic-ratelimit-input-tokens-limit"] == "100000"
        assert ok.headers["anthropic-ratelimit-tokens-limit"] == "100000"
        assert ok.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    refused = post(gateway, cluster, "one too many")
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "2 requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 59
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    row = audit_row(refused.headers["request-id"])
    assert (row.status, row.http_status, row.error_type) == ("rejected", 429, "rate_limit_error")


def test_a_keys_refusals_are_all_counted_but_only_sampled_into_the_audit(
    gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster]
) -> None:
    from messages_api.models import KeyUsage, MessageRequest

    gateway = gateways(AUDIT_REFUSED_SAMPLE_PER_S="2")
    cluster = make_cluster(gateway)
    limit_key(cluster, requests_per_minute=1)
    assert post(gateway, cluster, "hello [sim tokens=2]").status_code == 200
    started = time.monotonic()
    ids = []
    with httpx.Client(timeout=10) as client:
        for i in range(40):
            refused = client.post(gateway.url + "/v1/messages", json=body(cluster, f"over {i}"), headers=cluster.headers())
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
            assert 1 <= int(refused.headers["retry-after"]) <= 59
            ids.append(refused.headers["request-id"])
    elapsed = time.monotonic() - started
    # The key's usage counts every refusal...
    api_key = ApiKey.objects.get(key_hash=hash_key(cluster.key))
    wait_until(
        lambda: sum(u.errors.get("rate_limit_error", 0) for u in KeyUsage.objects.filter(api_key=api_key)) == 40,
        timeout=10, message="the key's usage does not count every refusal",
    )
    # ...but a key can send refusals as fast as its network allows: rows are written for a burst
    # of two and then two a second, each sample saying how many it stands for. An accepted request
    # afterwards is always written; the writer keeps order, so the samples before it are in too.
    from messages_api.auth import create_api_key

    _, other = create_api_key(f"marker-{time.monotonic_ns()}")
    marker = post(gateway, cluster, "accepted [sim tokens=2]", headers={**cluster.headers(), "x-api-key": other})
    assert marker.status_code == 200, marker.text
    audit_row(marker.headers["request-id"])
    written = list(MessageRequest.objects.filter(request_id__in=ids))
    assert 2 <= len(written) <= 2 + 2 * elapsed + 1, (len(written), elapsed)
    assert all((row.status, row.http_status, row.api_key_name) == ("rejected", 429, api_key.name) for row in written)
    if len(written) > 2:
        assert any("more refusals of this key not recorded" in row.error_message for row in written)


def test_a_streamed_answer_carries_the_headers_too(gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(gateway)
    limit_key(cluster, output_tokens_per_minute=1000)
    s = start_stream(gateway, cluster, "stream [sim tokens=2]")
    s.read_all()
    assert s.status == 200
    assert s.response_headers["anthropic-ratelimit-output-tokens-limit"] == "1000"
    assert s.response_headers["anthropic-ratelimit-output-tokens-remaining"] == str(1000 - 64)


def test_a_key_limited_to_some_models_sees_only_those(gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(gateway)
    limit_key(cluster, models=["claude-*"])
    refused = post(gateway, cluster, "not mine")
    assert refused.status_code == 404 and refused.json()["error"]["type"] == "not_found_error"
    models = httpx.get(gateway.url + "/v1/models", headers=cluster.headers(), timeout=10).json()
    assert [m["id"] for m in models["data"]] == []


# --- endpoint capacity and the admission queue --------------------------------------------------


def test_a_stream_that_finds_the_pool_full_pings_while_queued_then_gets_the_slot(
    gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster]
) -> None:
    gateway = gateways(**QUEUE_ENV)
    cluster = make_cluster(gateway, generation_capacity=1)
    holder = start_stream(gateway, cluster, f"first {HOLD}")
    holder.read_head()
    queued = start_stream(gateway, cluster, "second [sim tokens=2]")
    assert queued.read_head() == 200  # the status line within the start wait, while queued
    queued.read_until("ping")
    frames = queued.read_all()
    assert [f.event for f in frames if f.event != "ping"][-1] == "message_stop"
    holder.read_all()
    row = audit_row(queued.response_headers["request-id"])
    assert row.status == "completed" and row.queued_ms is not None and row.queued_ms > 500


def test_an_expired_wait_is_a_529_with_a_short_retry_after(gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster]) -> None:
    gateway = gateways(ADMISSION_QUEUE_TIMEOUT_S="0.5")
    cluster = make_cluster(gateway, generation_capacity=1)
    holder = start_stream(gateway, cluster, f"holds {HOLD}")
    holder.read_head()
    started = time.monotonic()
    refused = post(gateway, cluster, "waits too long")
    waited = time.monotonic() - started
    assert refused.status_code == 529, refused.text
    assert refused.json()["error"]["type"] == "overloaded_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 59
    assert 0.5 <= waited < 1.5  # the queue timeout, not longer (+1 s at most)
    holder.read_all()
    metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert metric_value(metrics, "gateway_admission_refusals_total", priority="standard", reason="timeout") >= 1


def test_a_client_leaving_while_queued_frees_its_place(gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster]) -> None:
    gateway = gateways(**QUEUE_ENV)
    cluster = make_cluster(gateway, generation_capacity=1)
    holder = start_stream(gateway, cluster, f"holds {HOLD}")
    holder.read_head()
    leaver = start_stream(gateway, cluster, "leaves while queued")
    leaver.read_head()

    def depth() -> float:
        return metric_value(httpx.get(gateway.url + "/metrics", timeout=10).text, "gateway_admission_queue_depth", priority="standard")

    wait_until(lambda: depth() == 1, message="the stream never queued")
    leaver.close()
    wait_until(lambda: depth() == 0, message="the queue kept the place of a client that left")
    row = audit_row(leaver.response_headers["request-id"])
    assert row.status == "cancelled"
    holder.read_all()


def test_an_interactive_key_goes_before_a_batch_key(
    gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster], transactional_db: Any
) -> None:
    gateway = gateways(**QUEUE_ENV)
    cluster = make_cluster(gateway, generation_capacity=1)
    from messages_api.auth import create_api_key

    _, batch = create_api_key(f"batch-{time.monotonic_ns()}")
    call_command("key_limits", ApiKey.objects.get(key_hash=hash_key(batch)).name, priority="batch")
    _, interactive = create_api_key(f"interactive-{time.monotonic_ns()}")
    call_command("key_limits", ApiKey.objects.get(key_hash=hash_key(interactive)).name, priority="interactive")
    holder = start_stream(gateway, cluster, f"holds {HOLD}")
    holder.read_head()
    batch_stream = RawStream.post_json(
        gateway.url + "/v1/messages", body(cluster, "batch [sim tokens=2]", stream=True), cluster.headers(**{"x-api-key": batch})
    )
    batch_stream.read_head()
    interactive_stream = RawStream.post_json(
        gateway.url + "/v1/messages", body(cluster, "interactive [sim tokens=2]", stream=True), cluster.headers(**{"x-api-key": interactive})
    )
    interactive_stream.read_head()
    holder.read_all()
    interactive_stream.read_all()
    batch_stream.read_all()
    first = audit_row(interactive_stream.response_headers["request-id"])
    second = audit_row(batch_stream.response_headers["request-id"])
    assert first.first_token_ms is not None and second.first_token_ms is not None
    # The batch request came first but waited for the interactive one.
    assert first.received_at + _ms(first.first_token_ms) < second.received_at + _ms(second.first_token_ms)


def test_a_flood_leaves_headroom_for_another_keys_next_request(
    gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster], transactional_db: Any
) -> None:
    gateway = gateways(ADMISSION_HEADROOM="0.25", ADMISSION_ACTIVE_FLOW_S="60", **QUEUE_ENV)
    cluster = make_cluster(gateway, generation_capacity=8)  # 8 slots, 2 of headroom
    from messages_api.auth import create_api_key

    _, quiet = create_api_key(f"quiet-{time.monotonic_ns()}")
    quiet_headers = cluster.headers(**{"x-api-key": quiet})
    assert httpx.post(gateway.url + "/v1/messages", json=body(cluster, "hello [sim tokens=2]"), headers=quiet_headers, timeout=30).status_code == 200
    # The quiet key is active: the flood gets its share (4) and more, but not the last 2 slots.
    flood = [start_stream(gateway, cluster, f"flood {i} {HOLD}") for i in range(8)]
    for stream in flood:
        stream.read_head()

    def depth() -> float:
        return metric_value(httpx.get(gateway.url + "/metrics", timeout=10).text, "gateway_admission_queue_depth", priority="standard")

    wait_until(lambda: depth() == 2, message="the flood did not leave the headroom")
    answer = httpx.post(gateway.url + "/v1/messages", json=body(cluster, "next [sim tokens=2]"), headers=quiet_headers, timeout=30)
    assert answer.status_code == 200, answer.text
    row = audit_row(answer.headers["request-id"])
    # A slot at once (it may pass through the queue, first in its order), not after the flood's 2 s.
    assert row.status == "completed" and (row.queued_ms or 0) < 500, row.queued_ms
    for stream in flood:
        assert [f.event for f in stream.read_all() if f.event != "ping"][-1] == "message_stop"


def _ms(value: float) -> Any:
    from datetime import timedelta

    return timedelta(milliseconds=value)


# --- shared across processes through Redis ---------------------------------------------------------


@pytest.fixture
def redis_gateways(gateways: Callable[..., Gateway]) -> Iterator[tuple[Gateway, Gateway]]:
    url = redis_url_or_skip()
    env = {"REDIS_URL": url, "ADMISSION_QUEUE_TIMEOUT_S": "0.5"}
    yield gateways(**env, GATEWAY_TEST_ROLE="a"), gateways(**env, GATEWAY_TEST_ROLE="b")


def test_a_keys_concurrency_holds_across_two_processes(redis_gateways: tuple[Gateway, Gateway], make_cluster: Callable[..., Cluster]) -> None:
    first, second = redis_gateways
    cluster = make_cluster(first, second)
    limit_key(cluster, concurrency=1)
    holder = start_stream(first, cluster, f"holds {HOLD}")
    holder.read_head()
    refused = post(second, cluster, "a second at once, elsewhere")
    assert refused.status_code == 429 and "1 concurrent requests" in refused.json()["error"]["message"]
    holder.read_all()
    assert post(second, cluster, "after it [sim tokens=2]").status_code == 200


def test_an_endpoints_capacity_holds_across_two_processes(redis_gateways: tuple[Gateway, Gateway], make_cluster: Callable[..., Cluster]) -> None:
    first, second = redis_gateways
    cluster = make_cluster(first, second, generation_capacity=1)
    holder = start_stream(first, cluster, f"holds {HOLD}")
    holder.read_head()
    refused = post(second, cluster, "the other process finds it full")
    assert refused.status_code == 529, refused.text
    holder.read_all()
    assert post(second, cluster, "free again [sim tokens=2]").status_code == 200


def test_without_redis_limits_fall_back_to_the_process_and_nothing_fails(
    gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster]
) -> None:
    # Nothing listens on port 9 (discard) here: every Redis call fails at once.
    gateway = gateways(REDIS_URL="redis://127.0.0.1:9/0", REDIS_RETRY_S="0.2")
    cluster = make_cluster(gateway, generation_capacity=4)
    limit_key(cluster, requests_per_minute=3)
    statuses = [post(gateway, cluster, f"fallback {i} [sim tokens=2]").status_code for i in range(4)]
    assert statuses == [200, 200, 200, 429]  # the limit still holds, per process
    metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    fallbacks = sum(
        metric_value(metrics, "gateway_shared_state_fallbacks_total", reason=reason)
        for reason in ("ConnectionError", "unavailable")
        if f'reason="{reason}"' in metrics
    )
    assert fallbacks >= 4
    assert metric_value(metrics, "gateway_shared_state_up") == 0
