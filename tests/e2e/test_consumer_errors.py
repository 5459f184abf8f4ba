"""A bug in our own code while a stream is being relayed, driven in-process (a socket client
cannot make the reframer raise): the error boundary still ends the stream with an `error` event,
closes it, stops the heartbeat and writes one `failed` row. Real sim workers, real database."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from channels.testing import ApplicationCommunicator

from messages_api.consumers import MessagesConsumer
from messages_api.reframe import StreamReframer
from tests.support.cluster import Cluster, audit_row, consumer_scope, reservations_closed
from tests.support.communicator import read_response, sse_events
from workers.cluster.registry import get_registry
from workers.schedule.pipeline import ChatRun

pytestmark = pytest.mark.django_db(transaction=True)


def break_reframer_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    feed = StreamReframer.feed
    calls = 0

    def broken_feed(self: StreamReframer, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        if calls == call:
            raise RuntimeError("a bug in the reframer")
        return feed(self, chunk)

    monkeypatch.setattr(StreamReframer, "feed", broken_feed)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_bug_mid_stream_ends_the_stream(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, settings: Any, stream: bool
) -> None:
    settings.MESSAGES_PING_INTERVAL_S = 0.1
    await get_registry().refresh()
    break_reframer_at(monkeypatch, 3)  # after message_start and a first delta went out
    communicator = ApplicationCommunicator(MessagesConsumer.as_asgi(), consumer_scope(cluster))
    body = {"model": cluster.model, "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": "x [sim tokens=20]"}]}
    await communicator.send_input({"type": "http.request", "body": orjson.dumps(body)})

    status, headers, raw = await read_response(communicator)
    request_id = headers[b"request-id"].decode()
    if stream:
        assert status == 200
        events = [e["type"] for e in sse_events(raw)]
        assert events[0] == "message_start" and events[-1] == "error", events
        assert "message_stop" not in events and "message_delta" not in events
        assert events[-2] == "content_block_stop"  # the open block is closed before the error
        error = sse_events(raw)[-1]["error"]
    else:
        assert status == 500
        error = orjson.loads(raw)["error"]
        assert orjson.loads(raw)["request_id"] == request_id
    assert error == {"type": "api_error", "message": "Internal server error"}
    # Nothing after the last frame: the heartbeat stopped with the stream.
    assert await communicator.receive_nothing(0.5)

    await communicator.send_input({"type": "http.disconnect"})
    await communicator.wait(5)
    row = await sync_to_async(audit_row)(request_id)
    assert row.status == "failed" and row.http_status == status and row.error_type == "api_error"
    assert "RuntimeError" in row.error_message  # for the operator; the client saw none of it
    rows = await sync_to_async(reservations_closed)(request_id)
    assert {r.stage: r.outcome for r in rows}["generation"] == "failure"
    await asyncio.to_thread(cluster.generation.wait_for, lambda s: s["active"] == 0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_an_answered_error_frees_its_request_without_the_garbage_collector(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """An error's traceback keeps the frames it passed through, and they keep the request (its
    parsed body, its run, its consumer): once answered, the request must be freed by reference
    counting, not left in a cycle for the collector's next full pass (under a flood of refused
    requests those cycles were most of the heap, and each full pass stalled the loop ~100 ms)."""
    await get_registry().refresh()
    runs: list[weakref.ref[ChatRun]] = []
    chat_run_init = ChatRun.__init__

    def tracked(self: ChatRun, *args: Any, **kwargs: Any) -> None:
        chat_run_init(self, *args, **kwargs)
        runs.append(weakref.ref(self))

    monkeypatch.setattr(ChatRun, "__init__", tracked)
    gc.collect()
    gc.disable()
    try:
        communicator = ApplicationCommunicator(MessagesConsumer.as_asgi(), consumer_scope(cluster))
        body = {"model": cluster.model, "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "x [sim gen_status=503]"}]}
        await communicator.send_input({"type": "http.request", "body": orjson.dumps(body)})
        status, headers, raw = await read_response(communicator)
        assert (status, raw.count(b'"error"')) != (200, 0)  # an error answer, in either form
        await communicator.wait(5)
        del communicator
        assert len(runs) == 1
        for _ in range(50):  # the run's close and the writer's hand-off take a few loop turns
            if runs[0]() is None:
                break
            await asyncio.sleep(0.01)
        assert runs[0]() is None, [type(r).__name__ for r in gc.get_referrers(runs[0]())]
    finally:
        gc.enable()
