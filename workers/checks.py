"""System checks of the registered cluster: every pool's protocol exists and can run its schedule
(and its conditional disaggregation, where it sets one).

Pools live in the database, so this check reads it; before `migrate` (no table yet) or without a
reachable database there is nothing to check and it says nothing.
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error
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
