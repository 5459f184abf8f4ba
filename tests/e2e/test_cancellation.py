"""Cancellation paths that a socket client cannot time precisely, driven in-process against real
sim workers: the server cancelling the handler, and a client leaving just after the context
phase issued its KV handoff."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from datetime import datetime, timezone
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from channels.testing import ApplicationCommunicator

from messages_api.consumers import MessagesConsumer
from tests.support.cluster import Cluster, audit_row, consumer_scope, reservations_closed
from workers.cluster.registry import get_registry
from workers.protocols import trtllm
from workers.schedule import pipeline

pytestmark = pytest.mark.django_db(transaction=True)


async def request_id_since(moment: datetime) -> str:
    from messages_api.models import MessageRequest
    from tests.support.cluster import wait_until

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


@pytest.mark.parametrize("phase", ["context", "generation"])
async def test_the_server_giving_up_during_the_cleanup_does_not_cut_it_short(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """The client leaves; while the consumer is still cleaning up, the server cancels it too (daphne
    does so `--application-close-timeout` seconds after a disconnect, 10 by default: on a loaded
    2-core machine a cleanup was seen to take longer). The cleanup still finishes: the worker's
    request ends and every reservation is released once. Before, the second cancellation
    interrupted ChatRun.close() and a real vLLM server kept generating for minutes."""
    await get_registry().refresh()
    # Widen the window: the pipeline takes 0.5 s to wind down once cancelled (a worker slow to
    # hang up, a loaded loop), and the server gives up on the consumer meanwhile.
    original_open = pipeline.ChatRun._open
    original_aclose = pipeline.ChunkStream.aclose

    async def slow_to_cancel(self: pipeline.ChatRun) -> None:
        try:
            await original_open(self)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)
            raise

    async def slow_to_close(self: pipeline.ChunkStream) -> None:
        await asyncio.sleep(0.5)
        await original_aclose(self)

    monkeypatch.setattr(pipeline.ChatRun, "_open", slow_to_cancel)
    monkeypatch.setattr(pipeline.ChunkStream, "aclose", slow_to_close)
    started = datetime.now(timezone.utc)
    communicator = ApplicationCommunicator(MessagesConsumer.as_asgi(), consumer_scope(cluster))
    directive = "[sim context_delay=30]" if phase == "context" else "[sim tokens=100000]"
    body = {"model": cluster.model, "max_tokens": 100000, "stream": True, "messages": [{"role": "user", "content": f"x {directive}"}]}
    await communicator.send_input({"type": "http.request", "body": orjson.dumps(body)})
    worker = cluster.context if phase == "context" else cluster.generation
    await asyncio.to_thread(worker.wait_for, lambda s: s["active"] == 1)
    request_id = await request_id_since(started)

    await communicator.send_input({"type": "http.disconnect"})
    await asyncio.sleep(0.2)  # the request's task is now in its cleanup
    communicator.future.cancel()  # the server gives up on the consumer
    with contextlib.suppress(asyncio.CancelledError):
        await communicator.future

    await asyncio.to_thread(worker.wait_for, lambda s: s["aborted"] == 1 and s["active"] == 0)
    rows = await sync_to_async(reservations_closed)(request_id)  # every one released
    outcomes = {r.stage: r.outcome for r in rows}
    assert outcomes["generation"] == "cancelled" and outcomes["context"] == ("cancelled" if phase == "context" else "success")
    row = await sync_to_async(audit_row)(request_id)
    assert row.status == "cancelled" and row.stage == phase


@pytest.mark.parametrize("phase", ["context", "generation"])
async def test_a_client_leaving_frees_its_request_without_the_garbage_collector(cluster: Cluster, phase: str) -> None:
    """A cancellation's traceback keeps the frames it passed through and their locals (the run,
    the consumer, the body): once the request is cleaned up they must be freed by reference
    counting, not wait in a cycle for the collector's full pass (Claude Code cancels a request
    whenever its user interrupts a turn)."""
    await get_registry().refresh()
    runs: list[weakref.ref[pipeline.ChatRun]] = []
    original_init = pipeline.ChatRun.__init__

    def tracked(self: pipeline.ChatRun, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        runs.append(weakref.ref(self))

    directive = "[sim context_delay=30]" if phase == "context" else "[sim tokens=100000]"
    body = {"model": cluster.model, "max_tokens": 100000, "stream": True, "messages": [{"role": "user", "content": f"x {directive}"}]}
    worker = cluster.context if phase == "context" else cluster.generation
    gc.collect()
    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline.ChatRun, "__init__", tracked)
            communicator = ApplicationCommunicator(MessagesConsumer.as_asgi(), consumer_scope(cluster))
            await communicator.send_input({"type": "http.request", "body": orjson.dumps(body)})
            await asyncio.to_thread(worker.wait_for, lambda s: s["active"] == 1)
            await communicator.send_input({"type": "http.disconnect"})
            await communicator.wait(10)
            del communicator
        await asyncio.to_thread(worker.wait_for, lambda s: s["aborted"] == 1 and s["active"] == 0)
        assert len(runs) == 1
        for _ in range(100):
            if runs[0]() is None:
                break
            await asyncio.sleep(0.01)
        assert runs[0]() is None
    finally:
        gc.enable()
