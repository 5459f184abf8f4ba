"""A worker stream whose bytes are all buffered still gives the event loop a turn every
`YIELD_EVERY_CHUNKS` chunks (workers/client.py): otherwise one fast stream holds the loop while
it relays, and other streams and this client's own hang-up wait behind it. Both ways a stream is
read: iterated, and pushed (`ChunkStream.pump`, as the gateway relays under daphne), where each
read is relayed in the callback that received it, so a read is bounded instead
(`workers.transport.PUSH_READ_BYTES`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.simworkers import SimWorker, start_simworker
from workers import client
from workers.transport import PUSH_READ_BYTES


@pytest.fixture(scope="module")
def unpaced_worker() -> Iterator[SimWorker]:
    worker = start_simworker("generation", tokens_per_second=0)
    yield worker
    worker.stop()


async def test_a_buffered_stream_lets_other_tasks_run(unpaced_worker: SimWorker) -> None:
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 5000,
        "messages": [{"role": "user", "content": "go [sim tokens=3000]"}],
    }
    stream = await client.open_stream(unpaced_worker.url + "/v1/chat/completions", body, stage="generation")
    await asyncio.sleep(0.5)  # the worker has sent everything it can; the transport has buffered it
    relayed = 0
    seen_at: list[int] = []

    async def other_task() -> None:
        while True:
            seen_at.append(relayed)
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_task())
    try:
        async for _ in stream:
            relayed += 1
    finally:
        ticker.cancel()
        await stream.aclose()
    assert relayed > 3000
    gaps = [b - a for a, b in zip(seen_at, seen_at[1:])]
    assert max(gaps) <= client.YIELD_EVERY_CHUNKS, max(gaps)


async def test_a_pushed_burst_lets_other_tasks_run(unpaced_worker: SimWorker) -> None:
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 5000,
        "messages": [{"role": "user", "content": "go [sim tokens=3000]"}],
    }
    stream = await client.open_stream(unpaced_worker.url + "/v1/chat/completions", body, stage="generation")
    relayed = 0
    seen_at: list[int] = []

    async def other_task() -> None:
        while True:
            seen_at.append(relayed)
            await asyncio.sleep(0)

    def count(_chunk: dict[str, object]) -> None:
        nonlocal relayed
        relayed += 1

    ticker = asyncio.create_task(other_task())
    try:
        # Pushed as the worker's bytes arrive: the unpaced worker sends its 3,000 tokens as fast
        # as the connection takes them, which would come in reads of up to 256 KiB. (What had
        # already arrived when the push began goes at once: the gateway pushes as soon as the
        # headers are in.)
        await stream.pump(count)
    finally:
        ticker.cancel()
        await stream.aclose()
    assert relayed > 3000
    gaps = [b - a for a, b in zip(seen_at, seen_at[1:])]
    # Each read holds at most PUSH_READ_BYTES, and this worker's chunks take ~230 bytes each on
    # the wire: ~280 per read. A 256 KiB read (asyncio's own bound) would be ~1,100.
    assert max(gaps) <= PUSH_READ_BYTES // 200, max(gaps)
