"""The protocol seam: a second protocol is one module and one `register` call.

`AggregatedOnly` below is such a module, written here rather than in `workers/protocols/`: a plain
OpenAI-compatible server with no context phase. It is driven through `ChatRun` against a real sim
generation worker; the pool refers to it by name like any other, and the system check, the
model's validation and `register_worker` all accept or refuse it from the registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, ClassVar

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from tests.support.cluster import Cluster, register_cluster, reservations_closed
from tests.support.simworkers import SimWorker
from workers import protocols
from workers.checks import check_pool_protocols
from workers.cluster.registry import PoolInfo, get_registry
from workers.exceptions import WorkerError
from workers.protocols.base import AGGREGATED, Call, WorkerProtocol
from workers.schedule.pipeline import ChatRun

pytestmark = pytest.mark.django_db(transaction=True)


class AggregatedOnly(WorkerProtocol):
    """The whole request to one worker, streamed. It asks for exactly three tokens (a sim
    directive) so the test can tell that the body the worker got is the one built here."""

    name: ClassVar[str] = "test-aggregated"
    label: ClassVar[str] = "test: aggregated only"
    schedules: ClassVar[frozenset[str]] = frozenset({AGGREGATED})

    def __init__(self) -> None:
        self.calls: list[str] = []

    def headers(self, body: dict[str, Any], call: Call) -> dict[str, str]:
        self.calls.append("headers")
        return {"x-request-id": call.request_id}

    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        self.calls.append("aggregated_request")
        messages = [*chat["messages"][:-1], {"role": "user", "content": chat["messages"][-1]["content"] + " [sim tokens=3]"}]
        return {**chat, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
def aggregated_only() -> Iterator[AggregatedOnly]:
    protocol = protocols.register(AggregatedOnly())
    yield protocol
    del protocols.PROTOCOLS[protocol.name]


@pytest.fixture
def cluster(transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker) -> Cluster:
    return register_cluster(context_worker, generation_worker)


async def pool_of(cluster: Cluster, **changes: str) -> PoolInfo:
    from workers.models import WorkerPool

    await WorkerPool.objects.filter(pk=cluster.pool.pk).aupdate(**changes)
    snapshot = await get_registry().refresh()
    pool = snapshot.pool_for_model(cluster.model)
    assert pool is not None
    return pool


CHAT = {"model": "sim-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}


async def test_a_registered_protocol_is_driven_through_chat_run(cluster: Cluster, aggregated_only: AggregatedOnly) -> None:
    pool = await pool_of(cluster, protocol="test-aggregated", schedule_style="aggregated")
    assert pool.protocol == "test-aggregated"
    async with ChatRun(dict(CHAT), pool=pool, request_id="req_protocol_test", tenant="k") as run:
        await run.stream_ready()
        chunks: list[dict[str, Any]] = []
        await run.relay(chunks.append)
    assert aggregated_only.calls == ["aggregated_request", "headers"]
    usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert usage["completion_tokens"] == 3  # the body this protocol built reached the worker
    progress = run.progress
    assert (progress.stage, progress.context_endpoint, progress.generation_endpoint) == ("done", "", cluster.generation.url)
    assert progress.context_done_at is None and progress.first_chunk_at is not None
    stats = await asyncio.to_thread(cluster.generation.wait_for, lambda s: s["completed"] == 1)
    assert stats["received"] == 1
    assert cluster.context.stats()["received"] == 0
    rows = await sync_to_async(reservations_closed)("req_protocol_test")
    assert [(r.stage, r.outcome) for r in rows] == [("generation", "success")]


async def test_trtllm_runs_both_phases_and_records_their_progress(cluster: Cluster) -> None:
    pool = await pool_of(cluster)
    assert pool.protocol == "trtllm"
    async with ChatRun(dict(CHAT), pool=pool, request_id="req_trtllm_progress") as run:
        assert run.rendered.messages  # the prompt, serialized once for both phases' bodies
        await run.stream_ready()
        # Both requests are sent: the serialized prompt is not held for the rest of the stream.
        with pytest.raises(RuntimeError):
            _ = run.rendered
        chunks: list[dict[str, Any]] = []
        await run.relay(chunks.append)
        assert chunks
    progress = run.progress
    assert (progress.stage, progress.context_endpoint, progress.generation_endpoint) == ("done", cluster.context.url, cluster.generation.url)
    assert progress.context_done_at is not None and progress.first_chunk_at is not None
    assert progress.context_done_at <= progress.first_chunk_at
    with pytest.raises(AttributeError):
        progress.stage = "received"  # type: ignore[misc]


@pytest.mark.parametrize("protocol,schedule", [("no-such-protocol", "context_first"), ("test-aggregated", "context_first")])
async def test_a_misconfigured_pool_fails_its_requests_before_any_worker(
    cluster: Cluster, aggregated_only: AggregatedOnly, protocol: str, schedule: str
) -> None:
    pool = replace(await pool_of(cluster), protocol=protocol, schedule_style=schedule)
    with pytest.raises(WorkerError) as failure:
        async with ChatRun(dict(CHAT), pool=pool, request_id="req_misconfigured") as run:
            await run.stream_ready()
    assert failure.value.status == 500 and failure.value.code == "misconfigured"
    assert "test-aggregated" not in failure.value.message and "no-such" not in failure.value.message
    assert aggregated_only.calls == []
    assert cluster.generation.stats()["received"] == 0 and cluster.context.stats()["received"] == 0


def test_the_system_check_reads_the_registry(cluster: Cluster, aggregated_only: AggregatedOnly) -> None:
    from workers.models import WorkerPool

    assert check_pool_protocols() == []
    WorkerPool.objects.filter(pk=cluster.pool.pk).update(protocol="test-aggregated")  # context_first
    [error] = check_pool_protocols()
    assert error.id == "workers.E001" and "cannot run the 'context_first' schedule" in error.msg
    WorkerPool.objects.filter(pk=cluster.pool.pk).update(schedule_style="aggregated")
    assert check_pool_protocols() == []
    del protocols.PROTOCOLS[aggregated_only.name]
    try:
        [error] = check_pool_protocols()
        assert "unknown worker protocol 'test-aggregated'" in error.msg
    finally:
        protocols.register(aggregated_only)


def test_model_validation_and_choices_follow_the_registry(cluster: Cluster, aggregated_only: AggregatedOnly) -> None:
    from workers.models import WorkerPool

    pool = WorkerPool.objects.get(pk=cluster.pool.pk)
    assert ("test-aggregated", "test: aggregated only") in pool._meta.get_field("protocol").choices
    pool.protocol = "test-aggregated"
    with pytest.raises(ValidationError) as invalid:
        pool.full_clean()
    assert "schedule_style" in invalid.value.message_dict
    pool.schedule_style = "aggregated"
    pool.full_clean()
    pool.protocol = "no-such-protocol"
    with pytest.raises(ValidationError) as invalid:
        pool.full_clean()
    assert "protocol" in invalid.value.message_dict


def test_register_worker_sets_the_protocol(transactional_db: Any, aggregated_only: AggregatedOnly) -> None:
    from workers.models import WorkerPool

    common = {"pool": "plain", "model": "plain-model", "role": "generation", "url": "http://127.0.0.1:9"}
    with pytest.raises(CommandError, match="cannot run the 'context_first' schedule"):
        call_command("register_worker", protocol="test-aggregated", **common)
    assert not WorkerPool.objects.filter(name="plain").exists()  # nothing half-written
    call_command("register_worker", protocol="test-aggregated", schedule_style="aggregated", **common)
    pool = WorkerPool.objects.get(name="plain")
    assert (pool.protocol, pool.schedule_style) == ("test-aggregated", "aggregated")
    with pytest.raises(CommandError):
        call_command("register_worker", protocol="no-such-protocol", **common)


# The endpoint inline's URLField warns about Django 6's https default; not what this test is about.
@pytest.mark.filterwarnings("ignore::django.utils.deprecation.RemovedInDjango60Warning")
def test_the_admin_edits_the_protocol(cluster: Cluster, admin_client: Any) -> None:
    page = admin_client.get(f"/admin/workers/workerpool/{cluster.pool.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<select name="protocol"' in html and '<option value="trtllm" selected>' in html
