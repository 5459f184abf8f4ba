"""Worker protocols: how a chat request is split into a context and a generation request.

One module per engine family implements `WorkerProtocol` (see `workers.protocols.base`) and is
registered here under the name a pool's `protocol` field holds. Adding one (vLLM's
`kv_transfer_params`, SGLang's bootstrap room, a plain OpenAI-compatible server) is writing its
module and adding it to `PROTOCOLS`; the pipeline, the admin's choices, `register_worker
--protocol` and the system check all read this registry.
"""

from __future__ import annotations

from workers.protocols import openai, sglang, trtllm, vllm
from workers.protocols.base import AGGREGATED, Call, ContextPeer, Handoff, WorkerProtocol
from workers.wire.error_reading import Wordings

DEFAULT = trtllm.PROTOCOL.name

PROTOCOLS: dict[str, WorkerProtocol] = {}
_error_wordings: Wordings = ()


def register(protocol: WorkerProtocol) -> WorkerProtocol:
    """Make `protocol` selectable by its name; a second protocol of the same name is an error."""
    existing = PROTOCOLS.get(protocol.name)
    if existing is not None and existing is not protocol:
        raise ValueError(f"a worker protocol named {protocol.name!r} is already registered: {existing!r}")
    PROTOCOLS[protocol.name] = protocol
    global _error_wordings
    _error_wordings = tuple(w for p in PROTOCOLS.values() for w in p.error_wordings)
    return protocol


register(trtllm.PROTOCOL)
register(vllm.PROTOCOL)
register(sglang.PROTOCOL)
register(openai.PROTOCOL)


def error_wordings() -> Wordings:
    """Every registered engine's wordings of a request that does not fit: a worker's error answer
    is read with all of them, not only its pool's protocol's. A pool's servers may be another
    engine's than its protocol names (a plain OpenAI pool fronts vLLM or SGLang; the simulated
    worker words its refusal as vLLM does, whatever its dialect), and no engine's sentence is
    another's."""
    return _error_wordings


def lookup(name: str) -> WorkerProtocol | None:
    return PROTOCOLS.get(name)


def choices() -> list[tuple[str, str]]:
    """`(name, label)` of every registered protocol (the model field's choices)."""
    return [(p.name, p.label) for p in sorted(PROTOCOLS.values(), key=lambda p: p.name)]


def misconfiguration(protocol: str, schedule_style: str, max_local_prefill_tokens: int = 0) -> str | None:
    """Why a pool with this protocol, schedule and conditional-disaggregation threshold cannot
    serve requests, or None if it can."""
    found = PROTOCOLS.get(protocol)
    if found is None:
        known = ", ".join(sorted(PROTOCOLS)) or "none"
        return f"unknown worker protocol {protocol!r} (registered: {known})"
    if schedule_style not in found.schedules:
        supported = ", ".join(sorted(found.schedules))
        return f"the {protocol} protocol cannot run the {str(schedule_style)!r} schedule (it supports: {supported})"
    if max_local_prefill_tokens and schedule_style != AGGREGATED and not found.generation_serves_whole_requests:
        return (
            f"the {protocol} protocol cannot skip the context phase (its generation servers refuse a request "
            "without a handoff): set max_local_prefill_tokens to 0"
        )
    return None


__all__ = [
    "AGGREGATED", "Call", "choices", "ContextPeer", "DEFAULT", "error_wordings", "Handoff", "lookup", "misconfiguration",
    "PROTOCOLS", "register", "WorkerProtocol",
]
