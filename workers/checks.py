"""System checks of the registered cluster: every pool's protocol exists and can run its schedule
(and its conditional disaggregation, where it sets one); and settings that no longer do anything.

Pools live in the database, so this check reads it; before `migrate` (no table yet) or without a
reachable database there is nothing to check and it says nothing.
"""

from __future__ import annotations

import os
from typing import Any

from django.core.checks import CheckMessage, Error, Warning
from django.db import DatabaseError

from workers import protocols


def check_pool_protocols(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from workers.models import WorkerPool

    try:
        pools = list(WorkerPool.objects.values_list("name", "protocol", "schedule_style", "max_local_prefill_tokens"))
    except DatabaseError:
        return []
    errors: list[CheckMessage] = []
    for name, protocol, schedule_style, max_local_prefill_tokens in pools:
        problem = protocols.misconfiguration(protocol, schedule_style, max_local_prefill_tokens)
        if problem is not None:
            errors.append(
                Error(
                    f"worker pool {name!r}: {problem}",
                    hint="Set the pool's protocol and schedule style in the admin or with "
                    "`manage.py register_worker --protocol … --schedule-style …`; "
                    "its requests fail until then.",
                    obj=f"WorkerPool {name!r}",
                    id="workers.E001",
                )
            )
    return errors


# Environment settings that once had an effect, with what replaced them.
RETIRED_SETTINGS = {
    "REDIS_MAX_CONNECTIONS": "the shared state now talks to Redis over one pipelined connection per "
    "event loop (disagg_project/redis_pipe.py); REDIS_MAX_IN_FLIGHT bounds the scripts in flight on it",
    "USAGE_FLUSH_INTERVAL_S": "usage per key and hour is written with the audit rows, in their transaction "
    "(AUDIT_FLUSH_INTERVAL_S), so that a crash cannot lose it while keeping the rows",
}


def check_retired_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """An operator who still sets a retired variable is told, rather than left believing it works."""
    return [
        Warning(f"{name} is set but no longer has any effect", hint=instead, id="workers.W001")
        for name, instead in RETIRED_SETTINGS.items()
        if name in os.environ
    ]
