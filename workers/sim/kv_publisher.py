"""The simulated worker's KV-cache event publisher, on vLLM's wire (`--kv-events-config`'s ZMQ
publisher, vLLM 0.32.0; facts in docs/engines.md):

- a PUB socket bound at `kv_events_address` sends `[topic, seq (8 bytes big-endian), payload]`,
  the payload msgpack `[ts, events, data_parallel_rank]` in the map layout
  (`workers.kv_events.decode.encode_batch`); `seq` counts from 0 per publisher;
- a ROUTER socket bound at `kv_replay_address` answers `[identity, b"", start_seq]` with every
  batch still in the ring (the last `buffer_steps`) whose seq is at least `start_seq`, each as
  `[identity, b"", topic, seq, payload]`, then `[identity, b"", b"", seq -1, b""]`.

One batch per cache change (a prompt's stores and the evictions they caused), as an engine
publishes one per step that produced events. Faults, for tests (`POST /sim/kv_events`):
`mode` "live" publishes; "drop" numbers and keeps batches in the ring but does not send them
live (a subscriber sees a gap that replay fills); "mute" publishes nothing at all (the events
stop); `restart` empties the cache and starts the seq at 0 again, as an engine's restart does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from workers.kv_events.decode import Event, encode_batch

MODES = ("live", "drop", "mute")


class KvPublisher:
    def __init__(self, address: str, replay_address: str = "", *, topic: str = "", buffer_steps: int = 10000) -> None:
        self.topic = topic.encode()
        self.mode = "live"
        self.published = 0
        self._seq = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(address)
        self._router: zmq.asyncio.Socket | None = None
        if replay_address:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_address)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve replays on the running loop."""
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays(), name="sim-kv-replay")

    def publish(self, events: Sequence[Event]) -> None:
        if self.mode == "mute" or not events:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(time.time(), events)
        self._ring.append((seq, payload))
        if self.mode == "live":
            # A PUB socket never blocks: past its high-water mark it drops, as an engine's does.
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.published += 1

    def restart(self) -> None:
        self._seq = 0
        self._ring.clear()

    async def _serve_replays(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM ignores what is not [identity, b"", start_seq]
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._ring):
                if seq >= start:
                    await self._router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._context.destroy(linger=0)
