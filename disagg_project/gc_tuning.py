"""The garbage collector in a long-running gateway: the start-up heap frozen, the thresholds
from settings, and every pass timed.

Each pass of Python's cyclic collector stops every thread, the event loop's with it, for as long
as it walks its generation: a full pass walks every tracked object made since start-up. What a
request leaves in reference cycles is freed only by such passes (disagg_project/tracebacks.py
keeps answered errors out of them), and under a flood what a full pass walks is the requests
waiting in the admission queue. `gateway_gc_pause_seconds` shows how long the loop stood still.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from django.conf import settings
from prometheus_client import Gauge, Histogram

__all__ = ["install"]

frozen = Gauge("gateway_gc_frozen_objects", "Objects loaded at start-up that the garbage collector no longer walks.")
frozen.set_function(gc.get_freeze_count)
pauses = Histogram(
    "gateway_gc_pause_seconds",
    "The garbage collector's passes by generation (2: full); every thread, the event loop's too, waits for each.",
    ["generation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
_by_generation = [pauses.labels(str(generation)) for generation in range(3)]
_started = 0.0


def _time_pass(phase: str, info: dict[str, Any]) -> None:
    global _started
    if phase == "start":
        _started = time.perf_counter()
    else:
        _by_generation[info["generation"]].observe(time.perf_counter() - _started)


def install() -> None:
    """Freeze what start-up loaded, set the thresholds, time every pass (once per process)."""
    # Everything loaded at start-up (Django, the app, their modules: ~80 MB of objects) moves out
    # of the collector's reach. Every full pass used to walk all of it: a ~30 ms stall of the loop
    # in the middle of request bursts (bench/stream_start.py: the last tenth of 200 simultaneous
    # requests parsed 30 ms late, their status lines with them). Objects made later are
    # collected as usual.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*settings.GATEWAY_GC_THRESHOLDS)
    if _time_pass not in gc.callbacks:
        gc.callbacks.append(_time_pass)
