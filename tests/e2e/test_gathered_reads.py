"""A worker read that brings several tokens leaves the gateway in one write (messages_api.consumers
.FrameWriter, handed to `ChatRun.relay` as its `Gather`), driven in-process against real sim
workers: the sim answers an unpaced stream in a few large writes, so reads hold many tokens."""

from __future__ import annotations

import orjson
import pytest
from channels.testing import ApplicationCommunicator

from messages_api.consumers import FrameWriter, MessagesConsumer
from tests.support.cluster import Cluster, consumer_scope
from tests.support.communicator import read_response, sse_events
from workers.cluster.registry import get_registry

pytestmark = pytest.mark.django_db(transaction=True)


async def test_the_tokens_of_one_read_are_written_together(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[int] = []  # frames per write to the client, while the stream relays
    release = FrameWriter.release

    def counted_release(self: FrameWriter) -> None:
        held = self._held
        if held:
            writes.append(len(held))
        release(self)

    monkeypatch.setattr(FrameWriter, "release", counted_release)
    await get_registry().refresh()
    communicator = ApplicationCommunicator(MessagesConsumer.as_asgi(), consumer_scope(cluster))
    body = {"model": cluster.model, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "x [sim tokens=40]"}]}
    await communicator.send_input({"type": "http.request", "body": orjson.dumps(body)})
    status, _, raw = await read_response(communicator)
    await communicator.send_input({"type": "http.disconnect"})
    await communicator.wait(5)

    assert status == 200
    events = sse_events(raw)
    assert events[-1]["type"] == "message_stop"
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert len(deltas) == 40
    # Some reads carried several tokens, and each such read was one write.
    assert writes and max(writes) > 1, writes

