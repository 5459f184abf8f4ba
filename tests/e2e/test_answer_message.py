"""`answer.answer_message`, a Messages request answered without HTTP, called in-process against
real sim worker processes with a real API key row on the test database: the Message on success
(its record ended COMPLETED), the front-door errors raised before acceptance (a 404 model, a 429
over the key's limits), a worker's error raised after it, and `end_failed` ending each failure's
record exactly once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command

from messages_api.answer import answer_message, end_failed
from messages_api.audit import AuditRecord
from messages_api.auth import Principal, hash_key, key_cache
from messages_api.errors import NotFound, RateLimited
from messages_api.models import ApiKey
from tests.support.cluster import Cluster, audit_row, register_cluster, reservations_closed
from tests.support.simworkers import SimWorker
from workers import Priority, WorkerError
from workers.cluster.registry import get_registry

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sim_cluster(transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker) -> Cluster:
    return register_cluster(context_worker, generation_worker)


class CountedRecord(AuditRecord):
    """An audit record that counts the calls that ended it."""

    endings = 0

    def end(self, status: str, **kwargs: Any) -> bool:
        ended = super().end(status, **kwargs)
        self.endings += ended
        return ended


def message_body(cluster: Cluster, text: str = "hello", *, model: str | None = None) -> bytes:
    return orjson.dumps({"model": model or cluster.model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]})


async def principal_of(cluster: Cluster) -> Principal:
    await get_registry().refresh()
    principal = await key_cache.authenticate(cluster.key)
    assert principal is not None
    return principal


def new_record(principal: Principal) -> CountedRecord:
    record = CountedRecord(route="BATCH test")
    record.api_key_name, record.api_key_id = principal.name, principal.key_id or None
    return record


async def test_a_message_is_answered_and_its_record_completed(sim_cluster: Cluster) -> None:
    principal = await principal_of(sim_cluster)
    record = new_record(principal)
    message = await answer_message(message_body(sim_cluster, "x [sim tokens=5]"), principal, record, priority=Priority.BATCH)
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == sim_cluster.model and message["stop_reason"] in ("end_turn", "max_tokens")
    assert message["content"] and message["content"][0]["type"] == "text"
    assert message["usage"]["output_tokens"] == record.output_tokens > 0
    assert record.endings == 1 and record.status == "completed" and record.http_status == 200
    row = await sync_to_async(audit_row)(record.request_id)
    assert (row.status, row.http_status, row.stream, row.pool_name) == ("completed", 200, False, sim_cluster.pool.name)
    await sync_to_async(reservations_closed)(record.request_id)


async def test_a_model_the_key_cannot_use_is_a_404_before_acceptance(sim_cluster: Cluster) -> None:
    principal = await principal_of(sim_cluster)
    record = new_record(principal)
    with pytest.raises(NotFound) as raised:
        await answer_message(message_body(sim_cluster, model="no-such-model"), principal, record, priority=Priority.BATCH)
    assert not record.begun and not record.ended  # left for the caller
    error = end_failed(record, raised.value)
    assert error is raised.value and (error.status, error.error_type) == (404, "not_found_error")
    assert record.endings == 1 and (record.status, record.http_status) == ("rejected", 404)
    assert end_failed(record, raised.value) is raised.value and record.endings == 1  # once
    row = await sync_to_async(audit_row)(record.request_id)
    assert (row.status, row.error_type, row.error_message) == ("rejected", "not_found_error", "model: no-such-model")


@pytest.fixture
def limited(sim_cluster: Cluster) -> Iterator[Cluster]:
    name = ApiKey.objects.get(key_hash=hash_key(sim_cluster.key)).name
    call_command("key_limits", name, requests_per_minute=1)
    yield sim_cluster


async def test_a_key_over_its_limits_is_a_429_before_acceptance(limited: Cluster) -> None:
    principal = await principal_of(limited)
    first = new_record(principal)
    await answer_message(message_body(limited), principal, first, priority=Priority.BATCH)
    record = new_record(principal)
    with pytest.raises(RateLimited) as raised:
        await answer_message(message_body(limited), principal, record, priority=Priority.BATCH)
    assert raised.value.retry_after is not None and raised.value.retry_after >= 1
    assert not record.begun and not record.ended
    end_failed(record, raised.value)
    assert record.endings == 1 and (record.status, record.http_status, record.error_type) == ("rejected", 429, "rate_limit_error")


async def test_a_workers_error_is_raised_and_ended_once_by_end_failed(sim_cluster: Cluster) -> None:
    principal = await principal_of(sim_cluster)
    record = new_record(principal)
    with pytest.raises(WorkerError) as raised:
        await answer_message(message_body(sim_cluster, "x [sim gen_status=500]"), principal, record, priority=Priority.BATCH)
    assert record.begun and not record.ended  # accepted, then failed: left for the caller
    error = end_failed(record, raised.value)
    assert (error.status, error.error_type) == (500, "api_error")
    assert record.endings == 1 and (record.status, record.http_status) == ("failed", 500)
    end_failed(record, RuntimeError("a second ending changes nothing"))
    assert record.endings == 1 and record.error_type == "api_error"
    row = await sync_to_async(audit_row)(record.request_id)
    assert (row.status, row.http_status) == ("failed", 500)
    rows = await sync_to_async(reservations_closed)(record.request_id)
    assert {r.stage: r.outcome for r in rows}["generation"] == "failure"
