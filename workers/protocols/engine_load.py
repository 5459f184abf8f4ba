"""What an engine says about its own load, read from its Prometheus metrics.

Each engine family names the same three figures differently (`LoadMetrics`): the requests waiting
in its scheduler's queue, those running, and the fraction of its KV cache in use. A protocol
names them (`WorkerProtocol.load_metrics`, with the path they are served at, `metrics_path`), and
`read_load` turns a scrape into an `EngineLoad`.

A worker is outside input. The caller bounds the body it reads; here only the lines of the named
metrics are kept (found by one regular expression, never a Python loop over the whole body), at
most `MAX_SERIES_LINES` of them, and only those reach the Prometheus parser. Values that are not
finite non-negative numbers are ignored; counts are truncated to integers, the KV fraction is
clamped to [0, 1].

Several series of one metric (data-parallel ranks, vLLM's `engine` label) add up; the KV figure is
the fullest one's. Where the engine labels its series by model (`model_label`), only the pool's
model's count; if none carries that model the engine serves it under another name, and all do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice

from prometheus_client.parser import text_string_to_metric_families

#: At most this many sample lines of the named metrics are parsed (an engine with many data
#: parallel ranks and models has a few dozen).
MAX_SERIES_LINES = 512


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One endpoint's load as its engine reported it."""

    #: Requests queued in the engine, not yet scheduled.
    waiting: int
    #: Requests the engine is running (prefilling or decoding).
    running: int
    #: Fraction of the KV cache in use, 0 to 1; None when the engine did not say.
    kv_usage: float | None = None

    @property
    def requests(self) -> int:
        return self.waiting + self.running


@dataclass(frozen=True, slots=True)
class LoadMetrics:
    """An engine's names for its load. Each figure is read from the first of its names present
    (a renamed metric keeps its former name listed after the new one)."""

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    #: The label naming the model a series is for (None: the engine labels none).
    model_label: str | None = "model_name"

    def names(self) -> tuple[str, ...]:
        return (*self.waiting, *self.running, *self.kv_usage)


_patterns: dict[LoadMetrics, re.Pattern[str]] = {}


def _pattern(metrics: LoadMetrics) -> re.Pattern[str]:
    pattern = _patterns.get(metrics)
    if pattern is None:
        names = "|".join(re.escape(name) for name in sorted(set(metrics.names()), key=len, reverse=True))
        # A sample line of one of the names: the name, its labels if any, then a blank.
        pattern = _patterns[metrics] = re.compile(rf"^(?:{names})(?:\{{[^\n]*\}})?[ \t][^\n]*$", re.MULTILINE)
    return pattern


def read_load(text: str, metrics: LoadMetrics, model: str | None = None) -> EngineLoad | None:
    """The load in the scrape `text`, or None when it has neither a waiting nor a running figure
    (metrics off, another engine, or not a scrape at all). Raises nothing on malformed input."""
    lines = [match.group() for match in islice(_pattern(metrics).finditer(text), MAX_SERIES_LINES)]
    if not lines:
        return None
    samples: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                value = float(sample.value)
                if math.isfinite(value) and value >= 0:
                    samples.setdefault(sample.name, []).append((sample.labels, value))
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    if model is not None and metrics.model_label is not None:
        samples = {name: _of_model(series, metrics.model_label, model) for name, series in samples.items()}
    waiting = _first(samples, metrics.waiting)
    running = _first(samples, metrics.running)
    if waiting is None and running is None:
        return None
    kv = _first(samples, metrics.kv_usage)
    return EngineLoad(
        waiting=int(sum(waiting or ())),
        running=int(sum(running or ())),
        kv_usage=None if not kv else min(1.0, max(kv)),
    )


def _of_model(series: list[tuple[Mapping[str, str], float]], label: str, model: str) -> list[tuple[Mapping[str, str], float]]:
    mine = [s for s in series if s[0].get(label) == model]
    return mine or series


def _first(samples: Mapping[str, list[tuple[Mapping[str, str], float]]], names: Iterable[str]) -> list[float] | None:
    for name in names:
        series = samples.get(name)
        if series:
            return [value for _, value in series]
    return None
