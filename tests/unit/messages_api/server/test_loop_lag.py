"""messages_api/server/loop_lag.py: the loop-lag monitor measures a blocked loop and sheds only
past its threshold."""

from __future__ import annotations

import asyncio
import threading
import time

from django.test import override_settings

from messages_api.server.loop_lag import LagMonitor


async def test_the_lag_monitor_measures_a_blocked_loop_and_sheds_past_its_threshold() -> None:
    monitor = LagMonitor()
    monitor.start(asyncio.get_running_loop())
    try:
        with override_settings(GATEWAY_SHED_LOOP_LAG_S=0.05):
            await asyncio.sleep(0.06)
            assert not monitor.overloaded()
            threading.Event().wait(0.2)  # the loop is held: the next probe runs ~0.2 s late
            for _ in range(3):
                await asyncio.sleep(0)  # the overdue probe runs
            assert monitor.lag > 0.1 and monitor.overloaded()
            await asyncio.sleep(0.12)
            assert not monitor.overloaded()  # on time again
        with override_settings(GATEWAY_SHED_LOOP_LAG_S=0):
            monitor.lag = 10.0
            assert not monitor.overloaded()  # 0 turns shedding off
    finally:
        monitor.stop()


async def test_a_request_received_before_the_loop_measured_itself_late_is_not_shed() -> None:
    # A burst's requests are read in one pass, before the probe that finds the loop late runs:
    # the lag they make together must not shed them, only the requests that arrive after.
    monitor = LagMonitor()
    monitor.start(asyncio.get_running_loop())
    try:
        with override_settings(GATEWAY_SHED_LOOP_LAG_S=0.05):
            await asyncio.sleep(0.06)
            arrived_with_the_burst = time.monotonic()
            threading.Event().wait(0.2)  # the burst's work holds the loop
            for _ in range(3):
                await asyncio.sleep(0)  # the overdue probe runs
            assert monitor.overloaded()  # a request arriving now is shed
            assert monitor.over_since is not None and monitor.over_since > arrived_with_the_burst
            assert not monitor.overloaded(arrived_with_the_burst)
            assert monitor.overloaded(time.monotonic())
    finally:
        monitor.stop()
