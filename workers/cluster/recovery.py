"""Closing what dead gateway processes left open.

Each process announces itself with a heartbeat row (`GatewayProcess`). A process on another host
is dead when its heartbeat is older than `GATEWAY_DEAD_AFTER_S`. A process on this host is
judged by its PID, which does not lag: dead at once when the PID is gone or a zombie (a restart
after a crash notices its predecessor immediately), alive while it runs even when its heartbeat
is late (a starved host — seen here: every process unscheduled for up to
10 s — delays heartbeats, and a live process's reservations and audit rows must not be closed
under its running requests), unless its heartbeat is older than `GATEWAY_HUNG_AFTER_S` (hung).
Its open reservations are closed as `abandoned`; `process_abandoned` tells other apps (the audit)
to close their rows too. Closing is idempotent, so several live processes sweeping at once do no
harm.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path

from django.conf import settings
from django.dispatch import Signal

from disagg_project import GATEWAY_INSTANCE
from workers.models import GatewayProcess, Outcome, Reservation

logger = logging.getLogger(__name__)

# Sent with `instances` (list of instance names) and `reason` (str) once their reservations are closed.
process_abandoned = Signal()

_STARTED_AT = datetime.now(timezone.utc)


def heartbeat() -> None:
    now = datetime.now(timezone.utc)
    GatewayProcess.objects.update_or_create(instance=GATEWAY_INSTANCE, defaults={"last_seen_at": now, "started_at": _STARTED_AT})


def _pid_on_this_host(instance: str) -> int | None:
    """The PID an instance name (`host:pid:nonce`) gives, when the host is this one."""
    host, _, rest = instance.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    return int(pid_text)


def _runs(pid: int) -> bool:
    """Whether `pid` is a running process on this host: not gone, not a zombie (a killed child
    its parent has not reaped). A PID given to another process after the gateway died looks
    alive here; the hung limit recovers that case. (Comparing start times would catch it at
    once, but needs the wall clock, which a paused VM moves under a live process.)"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    state = stat.rpartition(")")[2].split()[0]  # after the command name, which may hold spaces
    return state not in ("Z", "X")


def dead_instances(dead_after: float, hung_after: float | None = None) -> list[str]:
    now = datetime.now(timezone.utc)
    stale_before = now - timedelta(seconds=dead_after)
    hung_before = now - timedelta(seconds=hung_after if hung_after is not None else settings.GATEWAY_HUNG_AFTER_S)
    known = {p.instance: p for p in GatewayProcess.objects.filter(recovered_at__isnull=True).order_by()}
    # A process can die before its first heartbeat reached the database: its open rows name it.
    with_open_rows = set(
        Reservation.objects.filter(released_at__isnull=True).values_list("gateway_instance", flat=True).distinct()
    )
    dead = []
    for instance in set(known) | with_open_rows:
        if not instance or instance == GATEWAY_INSTANCE:
            continue
        process = known.get(instance)
        pid = _pid_on_this_host(instance)
        if pid is not None:
            if not _runs(pid):
                dead.append(instance)
            elif process is not None and process.last_seen_at < hung_before:
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
