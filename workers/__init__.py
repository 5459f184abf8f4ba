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
    cluster/     the cluster's state in this process: registry, health, recovery, the row writer,
                 and what processes share through Redis (shared_state)
    sim/         a simulated worker for every dialect (`manage.py simworker`)

The names load lazily: Django imports this package before its models are ready.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name → its module.
_HOMES = {
    "ChatRun": "workers.schedule.pipeline",
    "RenderedChat": "workers.schedule.rendered_chat",
    "RunTrace": "workers.schedule.trace",
    "Traced": "workers.schedule.trace",
    "count_prompt_tokens": "workers.schedule.prompt_tokens",
    "WorkerError": "workers.exceptions",
    "ContextLengthExceeded": "workers.exceptions",
    "NoEndpointAvailable": "workers.exceptions",
    "OutputLimitExceeded": "workers.exceptions",
    "StopRelay": "workers.exceptions",
    "PoolInfo": "workers.cluster.registry",
    "get_registry": "workers.cluster.registry",
    "GATEWAY_INSTANCE": "workers.cluster.instance",
    "new_id": "workers.cluster.instance",
    "get_writer": "workers.cluster.writer",
    "process_abandoned": "workers.cluster.recovery",
    "start_services": "workers.cluster.services",
    "close_transport": "workers.wire.client",
    "candidates": "workers.routing.router",
    "choose_pool": "workers.routing.router",
    "Served": "workers.cluster.registry",
    "AGGREGATED": "workers.protocols.base",
    "ReadOnlyAdmin": "workers.admin",
    "Priority": "workers.admission.queue",
    "admission_waiting": "workers.admission.queue",
    "DatabaseThread": "workers.cluster.db_thread",
    "limit_argument": "workers.management.arguments",
    "log_change": "workers.management.changes",
    "Script": "workers.cluster.shared_state",
    "get_shared_state": "workers.cluster.shared_state",
    "shared_leases": "workers.cluster.shared_state",
    "lease_expiry": "workers.cluster.shared_state",
    "GuardedAdmin": "workers.admin",
    "local_state": "workers.cluster.local_state",
}
__all__ = [
    "AGGREGATED",
    "ChatRun",
    "DatabaseThread",
    "RenderedChat",
    "ContextLengthExceeded",
    "GATEWAY_INSTANCE",
    "GuardedAdmin",
    "NoEndpointAvailable",
    "OutputLimitExceeded",
    "PoolInfo",
    "Priority",
    "ReadOnlyAdmin",
    "Served",
    "Script",
    "StopRelay",
    "RunTrace",
    "Traced",
    "WorkerError",
    "admission_waiting",
    "candidates",
    "choose_pool",
    "close_transport",
    "count_prompt_tokens",
    "get_registry",
    "get_shared_state",
    "lease_expiry",
    "limit_argument",
    "log_change",
    "new_id",
    "local_state",
    "get_writer",
    "process_abandoned",
    "shared_leases",
    "start_services",
]

if TYPE_CHECKING:
    from workers.admin import GuardedAdmin, ReadOnlyAdmin
    from workers.admission.queue import Priority, admission_waiting
    from workers.cluster.db_thread import DatabaseThread
    from workers.cluster.shared_state import Script, get_shared_state, lease_expiry
    from workers.cluster.shared_state import leases as shared_leases
    from workers.cluster.instance import GATEWAY_INSTANCE, new_id
    from workers.cluster.local_state import local_state
    from workers.cluster.recovery import process_abandoned
    from workers.cluster.registry import PoolInfo, Served, get_registry
    from workers.cluster.services import start_services
    from workers.cluster.writer import get_writer
    from workers.management.arguments import limit_argument
    from workers.management.changes import log_change
    from workers.exceptions import ContextLengthExceeded, NoEndpointAvailable, OutputLimitExceeded, StopRelay, WorkerError
    from workers.protocols.base import AGGREGATED
    from workers.routing.router import candidates, choose_pool
    from workers.schedule.pipeline import ChatRun
    from workers.schedule.rendered_chat import RenderedChat
    from workers.schedule.prompt_tokens import count_prompt_tokens
    from workers.schedule.trace import RunTrace, Traced
    from workers.wire.client import close_transport
else:

    def __getattr__(name: str) -> object:
        if name not in _HOMES:
            raise AttributeError(f"module 'workers' has no attribute {name!r}")
        module = importlib.import_module(_HOMES[name])
        return getattr(module, "leases" if name == "shared_leases" else name)
