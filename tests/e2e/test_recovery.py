"""Which gateway processes count as dead (workers.cluster.recovery.dead_instances), against real processes.

A process on this host is judged by its PID: a late heartbeat alone (a starved host) does not
make a running process dead, while a gone PID or a zombie does, and so does a heartbeat older
than the hung limit (which also covers a PID another process was given after the gateway died).
Another host's process is judged by its heartbeat."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

pytestmark = pytest.mark.django_db

HOST = socket.gethostname()
DEAD_AFTER_S = 15.0
HUNG_AFTER_S = 300.0


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def row(instance: str, *, started_ago: float = 0.0, seen_ago: float = 0.0) -> Any:
    """The process's heartbeat row; by default written as a process that started just now
    (after the test's processes began, as a real row's start is after its process began)."""
    from workers.models import GatewayProcess

    now = datetime.now(timezone.utc)
    return GatewayProcess.objects.create(
        instance=instance, started_at=now - timedelta(seconds=started_ago), last_seen_at=now - timedelta(seconds=seen_ago)
    )


def dead() -> list[str]:
    from workers.cluster.recovery import dead_instances

    return dead_instances(DEAD_AFTER_S, HUNG_AFTER_S)


def test_a_running_process_on_this_host_with_a_late_heartbeat_is_alive(sleeper: subprocess.Popen[bytes]) -> None:
    row(f"{HOST}:{sleeper.pid}:late", seen_ago=DEAD_AFTER_S * 4)
    assert dead() == []


def test_a_running_process_on_this_host_silent_past_the_hung_limit_is_dead(sleeper: subprocess.Popen[bytes]) -> None:
    instance = f"{HOST}:{sleeper.pid}:hung"
    row(instance, seen_ago=HUNG_AFTER_S + 1)
    assert dead() == [instance]


def test_a_gone_pid_on_this_host_is_dead_at_once() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    instance = f"{HOST}:{process.pid}:gone"
    row(instance)  # a fresh heartbeat
    assert dead() == [instance]


def test_a_zombie_on_this_host_is_dead() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # exited, not reaped: a zombie until wait()
            with open(f"/proc/{process.pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    break
            time.sleep(0.01)
        instance = f"{HOST}:{process.pid}:zombie"
        row(instance)
        assert dead() == [instance]
    finally:
        process.wait()


def test_this_process_is_never_dead() -> None:
    from disagg_project.ids import GATEWAY_INSTANCE

    row(GATEWAY_INSTANCE, seen_ago=HUNG_AFTER_S * 2)
    assert dead() == []


def test_another_hosts_process_is_judged_by_its_heartbeat() -> None:
    row(f"other-host.example:{os.getpid()}:a", seen_ago=DEAD_AFTER_S - 5)
    row(f"other-host.example:{os.getpid()}:b", seen_ago=DEAD_AFTER_S + 5)
    assert dead() == [f"other-host.example:{os.getpid()}:b"]
