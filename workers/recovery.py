"""Closing what dead gateway processes left open.

Each process announces itself with a heartbeat row (`GatewayProcess`). A process is dead when its
heartbeat is older than `GATEWAY_DEAD_AFTER_S`, or at once when it ran on this host and its PID
is gone (a restart after a crash notices its predecessor immediately). Its open reservations are
closed as `abandoned`; `process_abandoned` tells other apps (the audit) to close their rows too.
Closing is idempotent, so several live processes sweeping at once do no harm.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import datetime, timedelta, timezone

from django.db import close_old_connections
from django.dispatch import Signal

from workers.instance import GATEWAY_INSTANCE
from workers.models import GatewayProcess, Outcome, Reservation

logger = logging.getLogger(__name__)

# Sent with `instances` (list of instance names) and `reason` (str) once their reservations are closed.
process_abandoned = Signal()

_STARTED_AT = datetime.now(timezone.utc)


def heartbeat() -> None:
    now = datetime.now(timezone.utc)
    try:
        GatewayProcess.objects.update_or_create(
            instance=GATEWAY_INSTANCE, defaults={"last_seen_at": now, "started_at": _STARTED_AT}
        )
    finally:
        close_old_connections()


def _pid_gone_on_this_host(instance: str) -> bool:
    host, _, rest = instance.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def dead_instances(dead_after: float) -> list[str]:
    now = datetime.now(timezone.utc)
    stale_before = now - timedelta(seconds=dead_after)
    known = {p.instance: p for p in GatewayProcess.objects.filter(recovered_at__isnull=True)}
    # A process can die before its first heartbeat reached the database: its open rows name it.
    with_open_rows = set(
        Reservation.objects.filter(released_at__isnull=True).values_list("gateway_instance", flat=True).distinct()
    )
    dead = []
    for instance in set(known) | with_open_rows:
        if not instance or instance == GATEWAY_INSTANCE:
            continue
        process = known.get(instance)
        if _pid_gone_on_this_host(instance):
            dead.append(instance)
        elif process is not None:
            if process.last_seen_at < stale_before:
                dead.append(instance)
        elif _oldest_open_before(instance, stale_before):
            dead.append(instance)
    return sorted(dead)


def _oldest_open_before(instance: str, moment: datetime) -> bool:
    return Reservation.objects.filter(gateway_instance=instance, released_at__isnull=True, reserved_at__lt=moment).exists()


def sweep(dead_after: float) -> list[str]:
    """Close the open rows of dead processes; returns the instances recovered."""
    try:
        dead = dead_instances(dead_after)
        if not dead:
            return []
        now = datetime.now(timezone.utc)
        reason = "the gateway process handling this request died"
        # Separate statements, not one transaction: each is idempotent, and holding one table's
        # lock while waiting for another's could deadlock with other writers.
        closed = Reservation.objects.filter(gateway_instance__in=dead, released_at__isnull=True).update(
            released_at=now, outcome=Outcome.ABANDONED
        )
        process_abandoned.send(sender=GatewayProcess, instances=dead, reason=reason)
        GatewayProcess.objects.filter(instance__in=dead).update(recovered_at=now)
        logger.warning("recovered %d reservation(s) of dead gateway process(es) %s", closed, ", ".join(dead))
        return dead
    finally:
        close_old_connections()
