"""The Django project: settings, URLs, the ASGI application, and what both apps share.

The shared layer is what `messages_api` and `workers` both use and neither owns. Its modules import
neither app (`tests/unit/test_layers.py` enforces it), and the apps use only the names listed in
`__all__` below:

    shared_state.py, redis_pipe.py  what every gateway process shares through Redis, over one
                                    pipelined connection per event loop
    ids.py                          this process's name in the rows it writes, and the ids it makes
    writer.py                       the row writer: rows written in batches off the request's path
    db_thread.py                    a thread of its own per kind of background ORM work, keeping
                                    its connection
    admin_base.py                   the admin's base classes (secrets kept in; read-only rows)
    commands.py                     what the management commands share (limit arguments, the
                                    log of what they change)
    log_text.py, tracebacks.py      outside text made safe for a log line; answered errors' frames
                                    let go
    client_address.py               the client's address (the socket peer, or the one a trusted
                                    proxy names)
    telemetry.py                    OpenTelemetry tracing's facade (`tracing`: off unless the
                                    OTEL_* environment configures it; `RequestSpan`)

The rest is the project's own wiring: settings.py, urls.py, asgi.py (with gc_tuning.py,
log_queue.py, login_guard.py), admin.py (users and groups), otlp_exporter.py with
otlp_encoding.py (the OTLP span exporter telemetry.py installs, and its encoder) and relied_on.py
(every third-party internal the code relies on).

The names load lazily: Django imports this package to read its settings (`disagg_project.settings`),
before settings are configured and apps are loaded, and the admin base classes and the row writer
import Django's admin and ORM, which need both.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name → (module, attribute).
_HOMES = {
    "DatabaseThread": ("disagg_project.db_thread", "DatabaseThread"),
    "address_of": ("disagg_project.client_address", "address_of"),
    "drop_tracebacks": ("disagg_project.tracebacks", "drop_tracebacks"),
    "GATEWAY_INSTANCE": ("disagg_project.ids", "GATEWAY_INSTANCE"),
    "get_shared_state": ("disagg_project.shared_state", "get_shared_state"),
    "get_writer": ("disagg_project.writer", "get_writer"),
    "GuardedAdmin": ("disagg_project.admin_base", "GuardedAdmin"),
    "lease_expiry": ("disagg_project.shared_state", "lease_expiry"),
    "limit_argument": ("disagg_project.commands", "limit_argument"),
    "log_change": ("disagg_project.commands", "log_change"),
    "loggable": ("disagg_project.log_text", "loggable"),
    "new_id": ("disagg_project.ids", "new_id"),
    "ReadOnlyAdmin": ("disagg_project.admin_base", "ReadOnlyAdmin"),
    "Script": ("disagg_project.shared_state", "Script"),
    "shared_leases": ("disagg_project.shared_state", "leases"),
    "SharedState": ("disagg_project.shared_state", "SharedState"),
    "tracing": ("disagg_project.telemetry", "tracing"),
    "RequestSpan": ("disagg_project.telemetry", "RequestSpan"),
}
__all__ = [
    "address_of",
    "DatabaseThread",
    "drop_tracebacks",
    "GATEWAY_INSTANCE",
    "get_shared_state",
    "get_writer",
    "GuardedAdmin",
    "lease_expiry",
    "limit_argument",
    "log_change",
    "loggable",
    "new_id",
    "ReadOnlyAdmin",
    "RequestSpan",
    "Script",
    "shared_leases",
    "SharedState",
    "tracing",
]

if TYPE_CHECKING:
    from disagg_project.admin_base import GuardedAdmin, ReadOnlyAdmin
    from disagg_project.client_address import address_of
    from disagg_project.commands import limit_argument, log_change
    from disagg_project.db_thread import DatabaseThread
    from disagg_project.ids import GATEWAY_INSTANCE, new_id
    from disagg_project.log_text import loggable
    from disagg_project.shared_state import Script, SharedState, get_shared_state, lease_expiry
    from disagg_project.shared_state import leases as shared_leases
    from disagg_project.telemetry import RequestSpan, tracing
    from disagg_project.tracebacks import drop_tracebacks
    from disagg_project.writer import get_writer
else:

    def __getattr__(name: str) -> object:
        if name not in _HOMES:
            raise AttributeError(f"module 'disagg_project' has no attribute {name!r}")
        module, attribute = _HOMES[name]
        return getattr(importlib.import_module(module), attribute)
