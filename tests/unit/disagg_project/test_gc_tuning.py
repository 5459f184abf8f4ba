"""disagg_project.gc_tuning: the thresholds come from settings and every collector pass is timed."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
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


def test_the_thresholds_setting_is_three_non_negative_ints(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg_project.settings import env_gc_thresholds

    monkeypatch.delenv("GC_TEST", raising=False)
    assert env_gc_thresholds("GC_TEST", (700, 10, 10)) == (700, 10, 10)
    monkeypatch.setenv("GC_TEST", "1000, 10,20")
    assert env_gc_thresholds("GC_TEST", (700, 10, 10)) == (1000, 10, 20)
    for bad in ("1,2", "a,b,c", "-1,2,3", "1,2,3,4"):
        monkeypatch.setenv("GC_TEST", bad)
        with pytest.raises(ImproperlyConfigured, match="GC_TEST must be three non-negative integers"):
            env_gc_thresholds("GC_TEST", (700, 10, 10))
