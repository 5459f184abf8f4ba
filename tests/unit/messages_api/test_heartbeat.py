"""The heartbeat timer: pings a silent stream every interval, never while frames flow, and
stops cleanly.

Run on a virtual clock: an event loop whose `time()` only moves when the loop would otherwise
sleep, jumping straight to the next timer. Every wait is then exact and instant, so the tests
assert exact moments (and use the production interval of 10 s) without depending on how busy
the machine is. `messages_api.heartbeat` reads `time.monotonic()`; the tests point that module's
`time` at the loop's clock (the same clock asyncio's default loops use), so the module is
unchanged.
"""

from __future__ import annotations

import asyncio
import gc
import selectors
import time
import types
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from messages_api import heartbeat as heartbeat_module
from messages_api.heartbeat import Heartbeat

INTERVAL = 10.0  # the production default: free on a virtual clock


class _JumpingSelector(selectors.DefaultSelector):
    """Never blocks: when nothing is ready, moves the loop's clock by the timeout instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("deadlock: the loop would wait for ever (no timer, nothing ready)")
        assert self.loop is not None
        self.loop.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpingSelector()
        self.now = 1000.0
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self.now


def run_virtual(monkeypatch: pytest.MonkeyPatch, test: Callable[[VirtualClockLoop], Coroutine[Any, Any, None]]) -> float:
    """Run `test(loop)` on a virtual clock; returns the real seconds it took."""
    loop = VirtualClockLoop()
    monkeypatch.setattr(heartbeat_module, "time", types.SimpleNamespace(monotonic=loop.time))
    started = time.monotonic()
    try:
        loop.run_until_complete(test(loop))
    finally:
        loop.close()
    return time.monotonic() - started


def recording(loop: VirtualClockLoop, pings: list[float]) -> Heartbeat:
    """A heartbeat whose every ping appends its (virtual) time to `pings`."""

    async def send_ping() -> None:
        pings.append(loop.time())

    return Heartbeat(INTERVAL, send_ping)


def test_a_silent_stream_is_pinged_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    pings: list[float] = []

    async def scenario(loop: VirtualClockLoop) -> None:
        heartbeat = recording(loop, pings)
        started = loop.time()
        heartbeat.start()
        await asyncio.sleep(3.5 * INTERVAL)
        await heartbeat.stop()
        assert pings == [started + INTERVAL, started + 2 * INTERVAL, started + 3 * INTERVAL]
        assert heartbeat.pings_sent == 3
        await asyncio.sleep(5 * INTERVAL)
        assert len(pings) == 3  # nothing after stop

    assert run_virtual(monkeypatch, scenario) < 2.0  # 85 virtual seconds, no real waiting


def test_frames_postpone_the_ping_and_due_at_brings_it_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    pings: list[float] = []

    async def scenario(loop: VirtualClockLoop) -> None:
        heartbeat = recording(loop, pings)
        heartbeat.start()
        for _ in range(25):  # a frame every tenth of an interval, for 2.5 intervals
            await asyncio.sleep(INTERVAL / 10)
            heartbeat.sent()
        assert pings == []
        last_frame = loop.time()
        await asyncio.sleep(INTERVAL * 1.5)
        assert pings == [last_frame + INTERVAL]  # exactly one interval after the last frame
        due = loop.time() + 0.02
        heartbeat.due_at(due)
        await asyncio.sleep(0.05)
        assert pings[1:] == [due]  # well before the interval's own due time
        await heartbeat.stop()

    run_virtual(monkeypatch, scenario)


def test_a_frame_after_the_timer_was_armed_moves_the_ping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer is armed once; a frame sent later does not re-arm it, so when it fires early it
    must see the frame and wait out the rest of the interval."""
    pings: list[float] = []

    async def scenario(loop: VirtualClockLoop) -> None:
        heartbeat = recording(loop, pings)
        started = loop.time()
        heartbeat.start()
        await asyncio.sleep(INTERVAL * 0.7)
        heartbeat.sent()
        await asyncio.sleep(INTERVAL * 1.2)
        assert pings == [started + INTERVAL * 1.7]
        await heartbeat.stop()

    run_virtual(monkeypatch, scenario)


def test_stop_cancels_a_ping_in_flight_and_no_ping_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    async def scenario(loop: VirtualClockLoop) -> None:
        entered = asyncio.Event()

        async def slow_ping() -> None:
            nonlocal calls
            calls += 1
            entered.set()
            await asyncio.sleep(100 * INTERVAL)

        heartbeat = Heartbeat(INTERVAL, slow_ping)
        heartbeat.start()
        await entered.wait()
        assert loop.time() > 0
        await heartbeat.stop()
        await asyncio.sleep(10 * INTERVAL)  # many intervals: nothing may fire after stop
        assert calls == 1 and heartbeat.pings_sent == 0

    run_virtual(monkeypatch, scenario)


def test_stop_lets_go_of_the_owner_so_reference_counting_frees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual callback is a bound method of the heartbeat's owner, which holds the heartbeat:
    stopped, the heartbeat drops it, so the owner goes as soon as its last reference does."""

    class Stream:
        def __init__(self) -> None:
            self.heartbeat = Heartbeat(INTERVAL, self.ping)

        async def ping(self) -> None:
            pass

    async def scenario(loop: VirtualClockLoop) -> None:
        stream = Stream()
        stream.heartbeat.start()
        await stream.heartbeat.stop()
        gone = weakref.ref(stream)
        gc.disable()
        try:
            del stream
            assert gone() is None
        finally:
            gc.enable()

    run_virtual(monkeypatch, scenario)


def test_a_stopped_heartbeat_does_not_start_again(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(loop: VirtualClockLoop) -> None:
        async def send_ping() -> None:
            pass

        heartbeat = Heartbeat(INTERVAL, send_ping)
        heartbeat.start()
        await heartbeat.stop()
        with pytest.raises(RuntimeError):
            heartbeat.start()

    run_virtual(monkeypatch, scenario)
