"""Cancellation paths that a socket client cannot time precisely, driven in-process against real
sim workers: the server cancelling the handler, and a client leaving just after the context
phase issued its KV handoff."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from channels.testing import ApplicationCommunicator

from messages_api.consumers import MessagesConsumer
from tests.conftest import Cluster, audit_row, consumer_scope, reservations_closed
from workers import pipeline
from workers.protocols import trtllm
from workers.registry import get_registry

pytestmark = pytest.mark.django_db(transaction=True)


async def request_id_since(moment: datetime) -> str:
    from messages_api.models import MessageRequest
    from tests.conftest import wait_until

    return await sync_to_async(wait_until)(
        lambda: MessageRequest.objects.filter(received_at__gte=moment).values_list("request_id", flat=True).first()
    )


@pytest.mark.parametrize("stream", [True, False])
async def test_cancelling_the_handler_during_its_wait(cluster: Cluster, stream: bool) -> None:
    await get_registry().refresh()
    started = datetime.now(timezone.utc)
    communicator = ApplicationCommunicator(MessagesConsumer.as_asgi(), consumer_scope(cluster))
    body = {"model": cluster.model, "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "x [sim context_delay=30]"}]}
    await communicator.send_input({"type": "http.request", "body": orjson.dumps(body)})
    await asyncio.to_thread(cluster.context.wait_for, lambda s: s["active"] == 1)
    request_id = await request_id_since(started)

    communicator.future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await communicator.future

    await asyncio.to_thread(cluster.context.wait_for, lambda s: s["aborted"] == 1 and s["active"] == 0)
    row = await sync_to_async(audit_row)(request_id)
    assert row.status == "cancelled" and row.stage == "context"
    rows = await sync_to_async(reservations_closed)(request_id)
    assert {r.outcome for r in rows} == {"cancelled"}
    await asyncio.to_thread(cluster.generation.wait_for, lambda s: s["active"] == 0)


async def test_client_leaving_after_the_handoff_does_not_strand_it(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client goes away the instant the context worker issued its handoff: the generation
    request is still dispatched, so the generation worker takes the KV and the context worker
    frees it (kv_held back to 0) long before its own timeout."""
    snapshot = await get_registry().refresh()
    pool = snapshot.pool_for_model(cluster.model)
    assert pool is not None
    run_task: asyncio.Task[None] | None = None
    read_context_response = trtllm.read_context_response

    def read_and_leave(response: dict[str, Any]) -> trtllm.ContextResult:
        result = read_context_response(response)
        assert run_task is not None
        run_task.cancel()  # lands at the pipeline's next await: dispatching the generation request
        return result

    monkeypatch.setattr(trtllm, "read_context_response", read_and_leave)
    chat = {"model": cluster.model, "max_tokens": 8, "messages": [{"role": "user", "content": "handoff [sim tokens=4]"}]}

    async def serve() -> None:
        async with pipeline.ChatRun(chat, pool=pool, request_id="req_handoff_test") as run:
            await run.stream_ready()

    run_task = asyncio.create_task(serve())
    with pytest.raises(asyncio.CancelledError):
        await run_task
    stats = await asyncio.to_thread(cluster.context.wait_for, lambda s: s["kv_taken"] == 1 and s["kv_held"] == 0, 5.0)
    assert stats["completed"] == 1
    await asyncio.to_thread(cluster.generation.wait_for, lambda s: s["received"] == 1 and s["active"] == 0, 5.0)
    if cluster.pool.schedule_style == "context_first":
        rows = await sync_to_async(reservations_closed)("req_handoff_test")
        assert {r.stage: r.outcome for r in rows} == {"context": "success", "generation": "cancelled"}
