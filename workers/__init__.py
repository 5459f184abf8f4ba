"""The serving cluster: worker pools and endpoints, routing and reservations, the schedule that
drives a chat request through a context and a generation worker, and each engine's dialect.

It knows nothing of Anthropic. The front door (`messages_api`) and the project's wiring
(`disagg_project`) use only the names listed in `__all__` below, and the Django places every app
has (`workers.models`); `tests/unit/test_layers.py` enforces it. Inside, the package is in rooms:

    wire/        HTTP to workers: the client, the chat stream, transport and connection protocol,
                 the chunked and SSE decoders, the checks of what a worker sends, the error
                 boundary, the reading of its error answers, and redaction of its text
    protocols/   engine dialects (TensorRT-LLM, vLLM, SGLang, plain OpenAI), each with its errors
    routing/     picking an endpoint: the router, the prefix index, reservations
    admission/   endpoint capacity and the fair admission queue of requests waiting for it
    schedule/    one chat request through the cluster: the pipeline and what it records
    cluster/     the cluster's state in this process: registry, health, the engines' reported
                 load, recovery, the services it starts, and what this process alone knows
                 (local_state, for the admin)
    sim/         a simulated worker for every dialect (`manage.py simworker`)

What both apps share (Redis shared state, ids, the row writer, the admin's base classes, the
management commands' helpers) is in `disagg_project`, and used through its `__all__`.

The names load lazily: Django imports this package before its models are ready.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name → (module, attribute).
_HOMES = {
    "admission_waiting": ("workers.admission.queue", "admission_waiting"),
    "AGGREGATED": ("workers.protocols.base", "AGGREGATED"),
    "ChatRun": ("workers.schedule.pipeline", "ChatRun"),
    "choose_pool": ("workers.routing.router", "choose_pool"),
    "close_transport": ("workers.wire.client", "close_transport"),
    "ContextLengthExceeded": ("workers.exceptions", "ContextLengthExceeded"),
    "count_prompt_tokens": ("workers.schedule.prompt_tokens", "count_prompt_tokens"),
    "Gather": ("workers.wire.chat_stream", "Gather"),
    "get_registry": ("workers.cluster.registry", "get_registry"),
    "local_state": ("workers.cluster.local_state", "local_state"),
    "NoEndpointAvailable": ("workers.exceptions", "NoEndpointAvailable"),
    "OutputLimitExceeded": ("workers.exceptions", "OutputLimitExceeded"),
    "PoolInfo": ("workers.cluster.registry", "PoolInfo"),
    "Priority": ("workers.admission.queue", "Priority"),
    "process_abandoned": ("workers.cluster.recovery", "process_abandoned"),
    "RenderedChat": ("workers.schedule.rendered_chat", "RenderedChat"),
    "routable": ("workers.routing.router", "routable"),
    "RunProgress": ("workers.schedule.progress", "RunProgress"),
    "Served": ("workers.cluster.registry", "Served"),
    "start_services": ("workers.cluster.services", "start_services"),
    "StopRelay": ("workers.exceptions", "StopRelay"),
    "SupportsProgress": ("workers.schedule.progress", "SupportsProgress"),
    "WorkerError": ("workers.exceptions", "WorkerError"),
}
__all__ = [
    "admission_waiting",
    "AGGREGATED",
    "ChatRun",
    "choose_pool",
    "close_transport",
    "ContextLengthExceeded",
    "count_prompt_tokens",
    "Gather",
    "get_registry",
    "local_state",
    "NoEndpointAvailable",
    "OutputLimitExceeded",
    "PoolInfo",
    "Priority",
    "process_abandoned",
    "RenderedChat",
    "routable",
    "RunProgress",
    "Served",
    "start_services",
    "StopRelay",
    "SupportsProgress",
    "WorkerError",
]

if TYPE_CHECKING:
    from workers.admission.queue import Priority, admission_waiting
    from workers.cluster.local_state import local_state
    from workers.cluster.recovery import process_abandoned
    from workers.cluster.registry import PoolInfo, Served, get_registry
    from workers.cluster.services import start_services
    from workers.exceptions import ContextLengthExceeded, NoEndpointAvailable, OutputLimitExceeded, StopRelay, WorkerError
    from workers.protocols.base import AGGREGATED
    from workers.routing.router import choose_pool, routable
    from workers.schedule.pipeline import ChatRun
    from workers.schedule.progress import RunProgress, SupportsProgress
    from workers.schedule.prompt_tokens import count_prompt_tokens
    from workers.schedule.rendered_chat import RenderedChat
    from workers.wire.chat_stream import Gather
    from workers.wire.client import close_transport
else:

    def __getattr__(name: str) -> object:
        if name not in _HOMES:
            raise AttributeError(f"module 'workers' has no attribute {name!r}")
        module, attribute = _HOMES[name]
        return getattr(importlib.import_module(module), attribute)
