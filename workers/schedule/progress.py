"""How far a run got, as one immutable value: where it is, which endpoints it used, and when its
phases ended. The audit reads it; nothing else about a run's insides leaves `workers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RunProgress:
    #: A `Stage` value: where the request is, or where it ended.
    stage: str = "received"
    context_endpoint: str = ""
    generation_endpoint: str = ""
    #: `time.monotonic()` when the context worker answered (None: no context phase, or not yet).
    context_done_at: float | None = None
    #: `time.monotonic()` when the first chunk of the answer was handed on.
    first_chunk_at: float | None = None
    #: Seconds spent in the admission queue waiting for endpoint slots (every stage's waits).
    queued_s: float = 0.0


class SupportsProgress(Protocol):
    """Anything that exposes its current progress (a `ChatRun`)."""

    @property
    def progress(self) -> RunProgress: ...


__all__ = ["RunProgress", "SupportsProgress"]
