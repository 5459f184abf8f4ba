"""The Anthropic front door: `POST /v1/messages` (streamed and not), `count_tokens` and
`/v1/models` in Anthropic's exact protocol, converted to OpenAI chat for the cluster (`workers`)
and reframed back; API keys and the audit row of every request.

Other packages use only the names in `__all__` below and the Django places every app has
(`messages_api.models`, `messages_api.urls`); `tests/unit/test_layers.py` enforces it.

    validation.py, convert.py     an Anthropic request checked, then converted to OpenAI chat
    reframe.py, framing.py        OpenAI chunks → Anthropic events → server-sent-event frames
    consumers/, routes.py         the API routes' Channels consumers, and the ASGI routing to them
    answer.py, selection.py       a Messages request's one path (intake, pool, limits, run), with or
                                  without HTTP; the pool, session and message id it is served with
    errors.py                     Anthropic's error envelope, and the one mapping to it
    audit.py, auth.py, metrics.py the audit row, API keys, Prometheus metrics
    key_format.py                 the issued keys' form (a tag the gateway checks without the database)
    intake.py, limits/            bounded parsing of a body; per-key limits and their headers
    usage.py, usage_report.py     usage per key and hour (counted in memory, added to the rows);
    usage_chart.py                its admin page (SVG charts) and CSV
    batches/                      Message Batches: the API, the rows' store, the runner of their items
    answer.py                     one Messages request answered without HTTP (a batch item)
    server/                       daphne plumbing: the intake guard, direct writes, drain, state dump,
                                  the event loop's lag (shedding), memory given back, the access log,
                                  failed authentications per address (auth_throttle.py)

The names load lazily: Django imports this package before its models are ready.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name → (module, attribute).
_HOMES = {
    "http_application": ("messages_api.routes", "http_application"),
    "install_access_log": ("messages_api.server.access_log", "install"),
    "install_http_guard": ("messages_api.server.http_guard", "install"),
    "install_direct_writes": ("messages_api.server.direct_write", "install"),
    "install_drain": ("messages_api.server.drain", "install"),
    "install_state_dump": ("messages_api.server.state_dump", "install"),
    "install_loop_monitor": ("messages_api.server.loop_lag", "install"),
    "install_memory_return": ("messages_api.server.memory", "install"),
    "start_batch_runner": ("messages_api.batches.runner", "start"),
}
__all__ = [
    "http_application",
    "install_access_log",
    "install_direct_writes",
    "install_drain",
    "install_http_guard",
    "install_loop_monitor",
    "install_memory_return",
    "install_state_dump",
    "start_batch_runner",
]

if TYPE_CHECKING:
    from messages_api.batches.runner import start as start_batch_runner
    from messages_api.routes import http_application
    from messages_api.server.access_log import install as install_access_log
    from messages_api.server.direct_write import install as install_direct_writes
    from messages_api.server.drain import install as install_drain
    from messages_api.server.http_guard import install as install_http_guard
    from messages_api.server.loop_lag import install as install_loop_monitor
    from messages_api.server.memory import install as install_memory_return
    from messages_api.server.state_dump import install as install_state_dump
else:

    def __getattr__(name: str) -> object:
        if name not in _HOMES:
            raise AttributeError(f"module 'messages_api' has no attribute {name!r}")
        module, attribute = _HOMES[name]
        return getattr(importlib.import_module(module), attribute)
