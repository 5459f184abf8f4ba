"""The engine's own load in its Prometheus text, as each engine names it: the requests waiting and
running and the KV cache's use (`GET /metrics`, TensorRT-LLM's `/prometheus/metrics`).

The sim's figures are its own: requests waiting for a prefill slot (`--prefill-concurrency`), the
others in flight running, and the prefix cache's blocks held over its capacity. Outside load (an
engine also serving traffic that never passed through the gateway) is added on top: set at start
(`--outside-waiting`, `--outside-running`) or at any time with `POST /sim/outside_load`, which can
also make the metrics route answer an error status (an engine whose metrics are off or broken).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Where an engine serves its metrics and what it calls its load figures (the gateway reads
    them with its own copy of these names: `workers.protocols.*.load_metrics`)."""

    path: str
    waiting: str
    running: str
    kv_usage: str
    #: Labels on every series besides `model_name`, as the engine sets them.
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class OutsideLoad:
    """Load the sim reports beyond its own requests; `metrics_status` other than 200 makes the
    metrics route fail with that status."""

    waiting: int = 0
    running: int = 0
    #: The KV fraction to report when above the prefix cache's own (None: the cache's).
    kv_usage: float | None = None
    metrics_status: int = 200


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(names: MetricNames, model: str, *, waiting: int, running: int, kv_usage: float) -> bytes:
    """The three gauges in Prometheus text format (0.0.4), with a counter an engine also has, so
    that a reader must pick its lines out of others."""
    labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in (*names.labels, ("model_name", model)))
    lines = []
    for name, help_text, value in (
        (names.running, "Number of requests running.", float(running)),
        (names.waiting, "Number of requests waiting to be processed.", float(waiting)),
        (names.kv_usage, "KV-cache usage. 1 means 100 percent usage.", kv_usage),
    ):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    lines += ["# HELP process_open_fds Number of open file descriptors.", "# TYPE process_open_fds gauge", "process_open_fds 12.0"]
    return ("\n".join(lines) + "\n").encode()
