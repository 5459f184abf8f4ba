"""Message Batches through the official SDK (`client.messages.batches` and
`client.beta.messages.batches`) against a real daphne gateway, its batch runner, and real sim
workers: create, retrieve, list with paging, cancel, delete, results; the refusals; ownership.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from tests.support.batches import BATCH_ENV, item
from tests.support.cluster import Cluster, register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.sdk import sdk_client
from tests.support.simworkers import SimWorker


@pytest.fixture(scope="module")
def batch_gateways(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Callable[..., Gateway]]:
    """`batch_gateways(**env)` → a running gateway with a batch runner (one per distinct env),
    stopped with this module: a runner left running would claim the next module's items."""
    running: dict[tuple[tuple[str, str], ...], Gateway] = {}

    def get(**env: str) -> Gateway:
        key = tuple(sorted(env.items()))
        if key not in running:
            with django_db_blocker.unblock():
                running[key] = Gateway({**BATCH_ENV, **env}).start()
        return running[key]

    yield get
    for gateway in running.values():
        gateway.stop()


@pytest.fixture
def batch_gateway(batch_gateways: Callable[..., Gateway]) -> Gateway:
    return batch_gateways()


@pytest.fixture
def cluster(transactional_db: Any, batch_gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker) -> Cluster:
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(batch_gateway, cluster)
    return cluster


@pytest.fixture
def client(batch_gateway: Gateway, cluster: Cluster) -> Iterator[anthropic.Anthropic]:
    with sdk_client(batch_gateway.url, cluster.key) as c:
        yield c


def ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 30.0, beta: bool = False) -> Any:
    batches: Any = client.beta.messages.batches if beta else client.messages.batches
    return wait_until(
        lambda: (b := batches.retrieve(batch_id)).processing_status == "ended" and b, timeout, 0.1, f"batch {batch_id} never ended"
    )


def test_create_retrieve_results_delete(client: anthropic.Anthropic, cluster: Cluster) -> None:
    batch = client.messages.batches.create(
        requests=[item(f"req-{i}", f"item {i} [sim tokens={i + 1}]", cluster.model) for i in range(3)]  # type: ignore[misc]
    )
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 3 and batch.ended_at is None and batch.cancel_initiated_at is None
    assert (batch.expires_at - batch.created_at).total_seconds() == pytest.approx(24 * 3600, abs=1)
    done = ended(client, batch.id)
    assert done.request_counts.model_dump() == {"processing": 0, "succeeded": 3, "errored": 0, "canceled": 0, "expired": 0}
    assert done.results_url == f"/v1/messages/batches/{batch.id}/results" and done.ended_at is not None
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert sorted(results) == ["req-0", "req-1", "req-2"]
    for i in range(3):
        result = results[f"req-{i}"]
        assert result.type == "succeeded"
        assert result.message.usage.output_tokens == i + 1 and result.message.stop_reason == "end_turn"
    # Each item is an audit row of the batch's, completed.
    from messages_api.models import MessageRequest

    rows = wait_until(lambda: (r := list(MessageRequest.objects.filter(batch_id=batch.id))) and all(x.status == "completed" for x in r) and r)
    assert sorted(r.custom_id for r in rows) == ["req-0", "req-1", "req-2"]
    deleted = client.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_beta_form(client: anthropic.Anthropic, cluster: Cluster) -> None:
    beta = client.beta.messages.batches
    batch = beta.create(requests=[item("only", "beta [sim tokens=2]", cluster.model)])  # type: ignore[list-item]
    assert batch.processing_status == "in_progress"
    assert beta.retrieve(batch.id).id == batch.id
    assert [b.id for b in beta.list(limit=5)] == [batch.id]
    ended(client, batch.id, beta=True)
    results = list(beta.results(batch.id))
    assert [r.custom_id for r in results] == ["only"] and results[0].result.type == "succeeded"
    assert beta.delete(batch.id).type == "message_batch_deleted"


def test_list_newest_first_with_paging(client: anthropic.Anthropic, cluster: Cluster, batch_gateway: Gateway) -> None:
    ids = [client.messages.batches.create(requests=[item("a", "x [sim tokens=1]", cluster.model)]).id for _ in range(5)]  # type: ignore[list-item]
    newest_first = list(reversed(ids))
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    assert page.first_id == newest_first[0] and page.last_id == newest_first[1]
    assert [b.id for b in client.messages.batches.list(limit=2)] == newest_first  # the SDK's auto-paging
    older = client.messages.batches.list(limit=2, after_id=newest_first[1])
    assert [b.id for b in older.data] == newest_first[2:4] and older.has_more
    newer = client.messages.batches.list(limit=2, before_id=newest_first[3])
    assert [b.id for b in newer.data] == newest_first[1:3] and newer.has_more
    assert [b.id for b in client.messages.batches.list(limit=2, before_id=newest_first[2])] == newest_first[:2]
    default = httpx.get(batch_gateway.url + "/v1/messages/batches", headers=cluster.headers()).json()
    assert [b["id"] for b in default["data"]] == newest_first and default["has_more"] is False
    for limit in ("0", "1001", "x"):
        answer = httpx.get(batch_gateway.url + f"/v1/messages/batches?limit={limit}", headers=cluster.headers())
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


def test_another_keys_batch_is_not_found(client: anthropic.Anthropic, cluster: Cluster, batch_gateway: Gateway) -> None:
    from messages_api.auth import create_api_key

    batch = client.messages.batches.create(requests=[item("a", "mine [sim tokens=1]", cluster.model)])  # type: ignore[list-item]
    _, other_key = create_api_key("another-tenant")
    with sdk_client(batch_gateway.url, other_key) as other:
        for call in (other.messages.batches.retrieve, other.messages.batches.cancel, other.messages.batches.delete):
            with pytest.raises(anthropic.NotFoundError):
                call(batch.id)
        assert list(other.messages.batches.list()) == []
    answer = httpx.get(batch_gateway.url + f"/v1/messages/batches/{batch.id}/results", headers={**cluster.headers(), "x-api-key": other_key})
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"
    ended(client, batch.id)
    with sdk_client(batch_gateway.url, other_key) as other:
        with pytest.raises(anthropic.NotFoundError):
            other.messages.batches.results(batch.id)


def test_refused_whole(client: anthropic.Anthropic, cluster: Cluster, batch_gateway: Gateway) -> None:
    from messages_api.models import MessageBatch

    model = cluster.model
    cases: list[tuple[list[Any], str]] = [
        ([], "requests: List should have at least 1 item"),
        ([{"custom_id": "bad id", "params": item("x", "hi", model)["params"]}], "requests.0.custom_id: String should match pattern"),
        ([{"custom_id": "x" * 65, "params": item("x", "hi", model)["params"]}], "requests.0.custom_id"),
        ([item("same", "a", model), item("same", "b", model)], "requests.1.custom_id: Duplicate custom_id 'same'"),
        ([item("ok", "a", model), {"custom_id": "bad", "params": {"model": model, "messages": []}}], "requests.1.params.max_tokens: Field required"),
        ([item("ok", "a", model), item("s", "b", model, stream=True)], "requests.1.params.stream"),
    ]
    for requests, message in cases:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.batches.create(requests=requests)
        assert refused.value.status_code == 400 and message in refused.value.message, refused.value.message
    assert not MessageBatch.objects.exists()


def test_refused_model_and_sizes(cluster: Cluster, batch_gateways: Callable[..., Gateway]) -> None:
    from messages_api.auth import create_api_key
    from messages_api.models import ApiKey, MessageBatch

    gateway = batch_gateways(BATCH_MAX_REQUESTS="3", BATCH_MAX_BYTES="8000", MESSAGES_MAX_BODY_BYTES="4000")
    wait_registered(gateway, cluster)
    limited, limited_key = create_api_key("limited-models")
    ApiKey.objects.filter(pk=limited.pk).update(allowed_models=["other-*"])
    with sdk_client(gateway.url, limited_key) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.batches.create(requests=[item("a", "hi", "other-model"), item("b", "hi", cluster.model)])  # type: ignore[list-item]
        assert "requests.1.params.model" in refused.value.message
    with sdk_client(gateway.url, cluster.key) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.batches.create(requests=[item(f"i{n}", "hi", cluster.model) for n in range(4)])  # type: ignore[misc]
        assert "at most 3" in refused.value.message
        with pytest.raises(anthropic.APIStatusError) as too_large:
            client.messages.batches.create(requests=[item("big", "x" * 9000, cluster.model)])  # type: ignore[list-item]
        assert too_large.value.status_code == 413 and too_large.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
        assert not MessageBatch.objects.exists()
        # The batch route's limit is its own, both ways: a batch larger than a message may be...
        accepted = client.messages.batches.create(requests=[item("big", "x" * 5000 + " [sim tokens=1]", cluster.model)])  # type: ignore[list-item]
        assert accepted.request_counts.processing == 1
    # ...and a message of that size is still refused.
    answer = httpx.post(
        gateway.url + "/v1/messages", headers=cluster.headers(),
        json={"model": cluster.model, "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 5000}]},
    )
    assert answer.status_code == 413 and answer.json()["error"]["type"] == "request_too_large", answer.text


def test_worker_error_item_is_errored_with_the_envelope(client: anthropic.Anthropic, cluster: Cluster) -> None:
    batch = client.messages.batches.create(
        requests=[item("good", "fine [sim tokens=2]", cluster.model), item("bad", "refused [sim context_status=400]", cluster.model)]  # type: ignore[list-item]
    )
    done = ended(client, batch.id)
    assert done.request_counts.succeeded == 1 and done.request_counts.errored == 1
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert results["good"].type == "succeeded"
    bad = results["bad"]
    assert bad.type == "errored"
    assert bad.error.type == "error" and bad.error.error.type == "invalid_request_error"
    assert bad.error.request_id is not None and bad.error.request_id.startswith("req_")


def test_cancel_with_items_waiting(client: anthropic.Anthropic, cluster: Cluster) -> None:
    """The key may run one request at a time, so the items wait (refused for the key's limit, they
    go back to the queue): cancelled, the waiting ones are `canceled`, the running one finishes,
    and none starts after the cancellation."""
    from messages_api.models import ApiKey, BatchItem, MessageRequest

    ApiKey.objects.update(max_concurrency=1)  # before the key's first request: the gateway caches it
    batch = client.messages.batches.create(
        requests=[item(f"i{n}", f"slow {n} [sim context_delay=1 tokens=1]", cluster.model) for n in range(5)]  # type: ignore[misc]
    )
    wait_until(lambda: BatchItem.objects.filter(batch__batch_id=batch.id, request_id__gt="").count() >= 2, message="nothing ran")
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    assert canceling.request_counts.processing == 5 or canceling.processing_status == "ended"
    done = ended(client, batch.id)
    counts = done.request_counts
    assert counts.canceled >= 1 and counts.succeeded + counts.canceled == 5 and counts.processing == 0
    results = list(client.messages.batches.results(batch.id))
    assert len(results) == 5 and {r.result.type for r in results} <= {"succeeded", "canceled"}
    assert sum(r.result.type == "canceled" for r in results) == counts.canceled
    started_after = MessageRequest.objects.filter(batch_id=batch.id, received_at__gt=done.cancel_initiated_at)
    assert not started_after.exists()


def test_delete_and_results_wait_for_the_end(client: anthropic.Anthropic, cluster: Cluster, batch_gateway: Gateway) -> None:
    batch = client.messages.batches.create(requests=[item("a", "slow [sim context_delay=2 tokens=1]", cluster.model)])  # type: ignore[list-item]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.delete(batch.id)
    with pytest.raises(anthropic.AnthropicError, match="No `results_url`"):
        client.messages.batches.results(batch.id)
    answer = httpx.get(batch_gateway.url + f"/v1/messages/batches/{batch.id}/results", headers=cluster.headers())
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    ended(client, batch.id)
    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"


def test_expiry(cluster: Cluster, batch_gateways: Callable[..., Gateway]) -> None:
    """Unfinished items expire with their batch, running ones too (their runner gives them up at
    its next renewal, and writes nothing). Either of the module's gateways may have claimed them:
    both renew within BATCH_ENV's lease / 3, well inside the items' context delay."""
    from messages_api.models import BatchItem

    gateway = batch_gateways(BATCH_EXPIRY_S="1.5", BATCH_LEASE_S="1.5")
    wait_registered(gateway, cluster)
    with sdk_client(gateway.url, cluster.key) as client:
        batch = client.messages.batches.create(
            requests=[item(f"slow{n}", f"slow {n} [sim context_delay=8 tokens=1]", cluster.model) for n in range(2)]  # type: ignore[misc]
        )
        done = ended(client, batch.id, timeout=20)
        assert done.request_counts.expired == 2 and done.request_counts.processing == 0
        assert sorted(r.result.type for r in client.messages.batches.results(batch.id)) == ["expired", "expired"]
    wait_until(lambda: cluster.context.stats()["aborted"] >= 1, message="the expired items' worker requests were not aborted")
    assert all(i.result_type == "expired" for i in BatchItem.objects.filter(batch__batch_id=batch.id))


def test_an_overloaded_worker_is_retried_until_expiry_not_errored(cluster: Cluster, batch_gateways: Callable[..., Gateway]) -> None:
    """A worker that answers 503 (overloaded) makes its item wait and try again until its batch
    expires: `expired`, never `errored`. (A key's own limit, 429, likewise:
    test_cancel_with_items_waiting.)"""
    from messages_api.models import BatchItem

    gateway = batch_gateways(BATCH_EXPIRY_S="6")
    wait_registered(gateway, cluster)
    with sdk_client(gateway.url, cluster.key) as client:
        batch = client.messages.batches.create(
            requests=[item("busy", "[sim context_status=503]", cluster.model)]
            + [item(f"ok{n}", f"fine {n} [sim tokens=1]", cluster.model) for n in range(3)]  # type: ignore[list-item]
        )
        done = ended(client, batch.id, timeout=30)
        results = {r.custom_id: r.result.type for r in client.messages.batches.results(batch.id)}
    assert results == {"busy": "expired", "ok0": "succeeded", "ok1": "succeeded", "ok2": "succeeded"}
    assert done.request_counts.errored == 0
    assert BatchItem.objects.get(batch__batch_id=batch.id, custom_id="busy").attempts >= 2


def test_results_of_a_large_batch(cluster: Cluster, batch_gateway: Gateway) -> None:
    """20,000 results stream as JSON Lines (read from the database BATCH_RESULTS_CHUNK at a time),
    each line one item's, every item once. The rows are written here: the runner is not what is
    tested."""
    from datetime import datetime, timezone

    from messages_api.auth import hash_key
    from messages_api.batches import store
    from messages_api.batches.schema import ItemSpec
    from messages_api.models import ApiKey, BatchItem, MessageBatch

    key = ApiKey.objects.get(key_hash=hash_key(cluster.key))
    count = 20_000
    batch = store.create_batch(key.pk, key.name, [ItemSpec(f"item-{n}", b"{}") for n in range(count)])
    BatchItem.objects.filter(batch__batch_id=batch.batch_id).update(state="done", result_type="expired", result=store.EXPIRED_RESULT)
    MessageBatch.objects.filter(batch_id=batch.batch_id).update(processing_status="ended", ended_at=datetime.now(timezone.utc), expired=count)
    seen: set[str] = set()
    url = batch_gateway.url + f"/v1/messages/batches/{batch.batch_id}/results"
    with httpx.stream("GET", url, headers=cluster.headers(), timeout=60) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            parsed = orjson.loads(line)
            assert parsed == {"custom_id": parsed["custom_id"], "result": {"type": "expired"}}
            seen.add(parsed["custom_id"])
    assert seen == {f"item-{n}" for n in range(count)}


def test_revoking_the_key_ends_its_running_items_errored(client: anthropic.Anthropic, cluster: Cluster) -> None:
    """A key deactivated while its batch runs: the running items end `errored` with
    `authentication_error` (within the revocation check's interval), as its streams would."""
    from messages_api.models import ApiKey, BatchItem

    batch = client.messages.batches.create(requests=[item("long", "long [sim context_delay=30 tokens=1]", cluster.model)])  # type: ignore[list-item]
    wait_until(lambda: BatchItem.objects.filter(batch__batch_id=batch.id, state="running").exists(), message="the item never ran")
    ApiKey.objects.update(active=False)
    wait_until(lambda: BatchItem.objects.filter(batch__batch_id=batch.id, state="done").exists(), 20, 0.1, "the item was not revoked")
    done = BatchItem.objects.get(batch__batch_id=batch.id)
    result = orjson.loads(done.result or "")
    assert done.result_type == "errored" and result["error"]["error"]["type"] == "authentication_error"
    assert result["error"]["type"] == "error" and result["error"]["request_id"] == done.request_id
