"""The heartbeat timer: pings a silent stream every interval, never while frames flow, and
stops cleanly."""

from __future__ import annotations

import asyncio
import time

from messages_api.heartbeat import Heartbeat

INTERVAL = 0.05


async def test_a_silent_stream_is_pinged_every_interval() -> None:
    pings: list[float] = []

    async def send_ping() -> None:
        pings.append(time.monotonic())

    heartbeat = Heartbeat(INTERVAL, send_ping)
    started = time.monotonic()
    heartbeat.start()
    async with asyncio.timeout(5):
        while len(pings) < 3:
            await asyncio.sleep(INTERVAL / 5)
    await heartbeat.stop()
    gaps = [b - a for a, b in zip([started, *pings], pings)]
    assert all(INTERVAL * 0.9 <= gap < INTERVAL * 4 for gap in gaps), gaps
    assert heartbeat.pings_sent == len(pings)


async def test_frames_postpone_the_ping_and_due_at_brings_it_forward() -> None:
    pings: list[float] = []

    async def send_ping() -> None:
        pings.append(time.monotonic())

    interval = 0.2
    heartbeat = Heartbeat(interval, send_ping)
    heartbeat.start()
    for _ in range(25):  # frames for 2.5 intervals: each one postpones the ping
        await asyncio.sleep(interval / 10)
        heartbeat.sent()
    assert pings == []
    due = time.monotonic() + 0.02
    heartbeat.due_at(due)
    async with asyncio.timeout(5):
        while not pings:
            await asyncio.sleep(0.005)
    assert due - 0.002 <= pings[0] < due + interval / 2  # well before the interval's own due time
    await heartbeat.stop()


async def test_stop_cancels_a_ping_in_flight_and_no_ping_follows() -> None:
    entered = asyncio.Event()
    pings = 0

    async def slow_ping() -> None:
        nonlocal pings
        pings += 1
        entered.set()
        await asyncio.sleep(10)

    heartbeat = Heartbeat(0.01, slow_ping)
    heartbeat.start()
    await asyncio.wait_for(entered.wait(), 5)
    await heartbeat.stop()
    await asyncio.sleep(0.05)  # several intervals: nothing may fire after stop
    assert pings == 1 and heartbeat.pings_sent == 0
