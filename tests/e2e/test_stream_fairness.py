"""A fast worker stream still gives the event loop a turn every so often: otherwise one stream
holds the loop while it relays, and other streams and this client's own hang-up wait behind it.
A stream is pushed (`ChunkStream.pump`): each read is relayed in the callback that received it, so
a read is bounded (`workers.wire.push.PUSH_READ_BYTES`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from itertools import pairwise

import pytest

from tests.support.simworkers import SimWorker, start_simworker
from workers.wire import client
from workers.wire.push import PUSH_READ_BYTES


@pytest.fixture(scope="module")
def unpaced_worker() -> Iterator[SimWorker]:
    worker = start_simworker("generation", tokens_per_second=0)
    yield worker
    worker.stop()


BURST = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 5000,
    "messages": [{"role": "user", "content": "go [sim tokens=3000]"}],
}


class Ticker:
    """Another task on the loop: notes how many chunks had been relayed each time it ran."""

    def __init__(self) -> None:
        self.relayed = 0
        self.seen_at: list[int] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.seen_at.append(self.relayed)
            await asyncio.sleep(0)

    def count(self, _chunk: object) -> None:
        self.relayed += 1

    def stop(self) -> int:
        """The most chunks relayed between two of its turns."""
        self._task.cancel()
        return max(b - a for a, b in pairwise(self.seen_at))


async def test_a_pushed_burst_lets_other_tasks_run(unpaced_worker: SimWorker) -> None:
    stream = await client.open_stream(unpaced_worker.url + "/v1/chat/completions", BURST, stage="generation")
    ticker = Ticker()
    try:
        # Pushed as the worker's bytes arrive: the unpaced worker sends its 3,000 tokens as fast
        # as the connection takes them, which would come in reads of up to 256 KiB. (What had
        # already arrived when the push began goes at once: the gateway pushes as soon as the
        # headers are in.)
        await stream.pump(ticker.count)
    finally:
        gap = ticker.stop()
        await stream.aclose()
    assert ticker.relayed > 3000
    # Each read holds at most PUSH_READ_BYTES, and this worker's chunks take ~230 bytes each on
    # the wire: ~280 per read. A 256 KiB read (asyncio's own bound) would be ~1,100.
    assert gap <= PUSH_READ_BYTES // 200, gap
