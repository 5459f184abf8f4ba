"""disagg_project.gc_tuning: the thresholds come from settings and every collector pass is timed."""

from __future__ import annotations

import gc
from typing import Any

from prometheus_client import REGISTRY

from disagg_project import gc_tuning


def passes(generation: int) -> float:
    return REGISTRY.get_sample_value("gateway_gc_pause_seconds_count", {"generation": str(generation)}) or 0.0


def test_the_thresholds_are_set_and_every_pass_is_timed_once(settings: Any) -> None:
    settings.GATEWAY_GC_THRESHOLDS = (5000, 20, 30)
    thresholds = gc.get_threshold()
    try:
        gc_tuning.install()
        gc_tuning.install()  # a second install adds no second timer
        assert gc.get_threshold() == (5000, 20, 30)
        assert gc.get_freeze_count() > 0
        before = passes(2), passes(1)
        gc.collect()
        gc.collect(1)
        assert (passes(2), passes(1)) == (before[0] + 1, before[1] + 1)
        seconds = REGISTRY.get_sample_value("gateway_gc_pause_seconds_sum", {"generation": "2"})
        assert seconds is not None and 0 < seconds < 60
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(gc_tuning._time_pass)
        gc.unfreeze()
