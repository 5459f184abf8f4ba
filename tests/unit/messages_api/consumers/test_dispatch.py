"""How a request reaches the consumer's handlers: read in place without a channel layer
(`RequestTask.serve_in_place`, messages_api/consumers/dispatch.py), through Channels' own loop with one."""

from __future__ import annotations

import asyncio
from typing import Any

from channels.exceptions import StopConsumer
from django.test import override_settings

from messages_api.consumers import ApiConsumer, ResponseState
from messages_api.consumers.dispatch import RequestTask

IN_MEMORY_LAYER = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


class RecordingConsumer(ApiConsumer):
    """Notes the loop turn at which each message reaches `dispatch`, and stops at the disconnect."""

    def __init__(self, turns: list[int], clock: list[int]) -> None:
        super().__init__()
        self.turns = turns
        self.clock = clock
        self.messages: list[dict[str, Any]] = []

    async def dispatch(self, message: dict[str, Any]) -> None:
        self.turns.append(self.clock[0])
        self.messages.append(message)
        if message["type"] == "http.disconnect":
            raise StopConsumer()


async def turns_to_dispatch() -> tuple[list[int], RecordingConsumer]:
    """Run a consumer on a request whose body and disconnect are already queued, counting loop
    turns with a task that ticks once per turn."""
    clock = [0]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0)
            clock[0] += 1

    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    queue.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})
    queue.put_nowait({"type": "http.disconnect"})
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    turns: list[int] = []
    consumer = RecordingConsumer(turns, clock)
    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker runs from here on
    start = clock[0]
    await consumer({"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}, queue.get, send)
    ticker.cancel()
    return [turn - start for turn in turns], consumer


async def test_without_a_channel_layer_queued_messages_are_dispatched_in_place() -> None:
    turns, consumer = await turns_to_dispatch()
    assert [m["type"] for m in consumer.messages] == ["http.request", "http.disconnect"]
    assert turns[0] <= 1, turns
    assert turns[1] - turns[0] <= 1, turns
    assert consumer.channel_layer is None
    assert consumer.scope["path"] == "/v1/messages"


async def test_with_a_channel_layer_channels_own_loop_dispatches() -> None:
    with override_settings(CHANNEL_LAYERS=IN_MEMORY_LAYER):
        turns, consumer = await turns_to_dispatch()
    assert [m["type"] for m in consumer.messages] == ["http.request", "http.disconnect"]
    # Channels' loop: a task per read, then asyncio.wait; the count the direct loop saves.
    assert turns[0] >= 3, turns
    assert consumer.channel_layer is not None


class ServedConsumer(ApiConsumer):
    """Notes the task its request runs in, and waits until it is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.served_in: list[asyncio.Task[Any] | None] = []
        self.cancelled = asyncio.Event()

    async def handle_request(self, body: bytes) -> None:
        self.served_in.append(asyncio.current_task())
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def serve_until_the_client_leaves() -> tuple[asyncio.Task[None], ServedConsumer]:
    """Run a consumer on a complete request, then disconnect once its work has started; returns
    the application's task (ended) and the consumer."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    queue.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})

    async def send(message: dict[str, Any]) -> None:
        pass

    consumer = ServedConsumer()
    application = asyncio.create_task(
        consumer({"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}, queue.get, send)
    )
    while not consumer.served_in:
        await asyncio.sleep(0)
    queue.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(consumer.cancelled.wait(), 5)
    await asyncio.wait({application}, timeout=5)
    assert application.done()
    return application, consumer


async def test_without_a_channel_layer_the_request_runs_in_the_applications_task_until_the_client_leaves() -> None:
    application, consumer = await serve_until_the_client_leaves()
    # A turn sooner than from a task of its own: the request's start is on every request's path.
    assert consumer.served_in == [application]


async def test_with_a_channel_layer_the_request_runs_in_a_task_of_its_own() -> None:
    with override_settings(CHANNEL_LAYERS=IN_MEMORY_LAYER):
        application, consumer = await serve_until_the_client_leaves()
    assert len(consumer.served_in) == 1
    assert consumer.served_in[0] is not application


async def test_a_finished_responses_disconnect_cancels_nothing_and_an_unfinished_ones_cancels_once() -> None:
    """Daphne sends http.disconnect after a complete response too: the work is then only finishing
    its bookkeeping. And nothing is cancelled before the work runs (`revoke` relies on it)."""
    running = RequestTask()
    assert running.cancel() is False  # no work yet
    release = asyncio.Event()
    running.start(release.wait())  # no channel layer in play: a task of its own
    assert running.task is not None
    running.client_left(finished=True)
    await asyncio.sleep(0)
    assert not running.task.cancelling()
    running.client_left(finished=False)
    assert running.task.cancelling() == 1
    await running.close()  # already cancelled: not again, only awaited
    assert running.task.cancelled()
    assert running.cancel() is False  # done


async def test_a_consumer_moves_from_receiving_to_answering_once_its_body_is_complete() -> None:
    consumer = ServedConsumer()
    consumer.scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}  # type: ignore[assignment]
    assert consumer.state is ResponseState.RECEIVING
    await consumer.http_request({"type": "http.request", "body": b"{", "more_body": True})
    assert consumer.state is ResponseState.RECEIVING
    await consumer.http_request({"type": "http.request", "body": b"}", "more_body": False})
    assert consumer.state is ResponseState.ANSWERING
    await consumer.http_request({"type": "http.request", "body": b"ignored", "more_body": False})  # read no more
    while not consumer.served_in:
        await asyncio.sleep(0)
    await consumer._running.close()  # the application ending: the work is cancelled and awaited
    assert consumer.cancelled.is_set()
