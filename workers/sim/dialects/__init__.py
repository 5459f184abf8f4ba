"""The disaggregation dialects the simulator speaks (`simworker --protocol NAME`).

A dialect reads its engine's wire form of a disaggregated request into the simulator's neutral
`DisaggParams` (which handoff, from where, whether to wait for it), refuses what the real engine
would refuse, and writes the context worker's answer the way that engine writes it. The rest of
the simulator (prefill timing, the handoff store, the KV pull, streaming) is shared.

Adding a dialect is a module with a `Dialect` subclass and a line in `DIALECTS`.
"""

from __future__ import annotations

from .base import ContextIssue, Dialect
from .openai import OpenAIDialect
from .sglang import SglangDialect
from .trtllm import TrtllmDialect
from .vllm import VllmDialect

DEFAULT = "trtllm"

DIALECTS: dict[str, Dialect] = {d.name: d for d in (TrtllmDialect(), VllmDialect(), SglangDialect(), OpenAIDialect())}


def names() -> tuple[str, ...]:
    return tuple(sorted(DIALECTS))


def get(name: str) -> Dialect:
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(f"unknown sim protocol {name!r} (known: {', '.join(names())})") from None


__all__ = ["ContextIssue", "DEFAULT", "Dialect", "DIALECTS", "get", "names"]
