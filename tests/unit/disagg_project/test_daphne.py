"""disagg_project/daphne.py: the hooks a gateway process installs around daphne, in their order and
under their conditions, each handed what it needs of the running daphne. What each hook does is
tested with its module (tests/unit/messages_api/server/test_direct_write.py, tests/e2e/test_http_guard.py,
test_state_dump.py, test_processes.py, ...)."""

from __future__ import annotations

import socket
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from disagg_project import daphne as hooks
from disagg_project import gc_tuning, log_queue
from disagg_project.daphne import (
    HOOKS,
    Daphne,
    Hook,
    install_all,
    no_delay_on_listening_sockets,
    running_daphne,
)


class RecordingLoop:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        self.calls.append(("loop.call_soon", callback, *args))


class RecordingReactor:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def getReaders(self) -> list[Any]:
        return []

    def addSystemEventTrigger(self, phase: str, event_type: str, call: Callable[[], object]) -> None:
        self.calls.append(("reactor.addSystemEventTrigger", phase, event_type, call))


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> tuple[Daphne, list[tuple[Any, ...]]]:
    """A stand-in daphne, and every install the hooks make recorded instead of done."""
    calls: list[tuple[Any, ...]] = []

    def recorder(name: str) -> Callable[..., None]:
        return lambda *args: calls.append((name, *args))

    for name in (
        "install_http_guard", "install_direct_writes", "install_state_dump", "install_loop_monitor",
        "install_memory_return", "install_access_log", "install_drain",
    ):
        monkeypatch.setattr(hooks, name, recorder(name))
    monkeypatch.setattr(log_queue, "install", recorder("log_queue.install"))
    monkeypatch.setattr(sys, "setswitchinterval", recorder("sys.setswitchinterval"))
    server = types.ModuleType("daphne.server")
    daphne = Daphne(server, RecordingReactor(calls), RecordingLoop(calls))  # type: ignore[arg-type]
    monkeypatch.setattr(hooks, "running_daphne", lambda: daphne)
    return daphne, calls


def test_the_hooks_keep_their_order() -> None:
    assert [hook.name for hook in HOOKS] == [
        "http guard",
        "direct writes",
        "background services and the batch runner, then the collector's tuning",
        "switch interval",
        "state dump",
        "loop monitor",
        "memory return",
        "log queue",
        "tracing",
        "access log",
        "TCP_NODELAY",
        "worker transport closed at shutdown",
        "drain",
    ]


def test_each_hook_gets_what_it_needs_of_daphne_in_order(recorded: tuple[Daphne, list[tuple[Any, ...]]], settings: Any) -> None:
    settings.GATEWAY_DIRECT_WRITES = True
    settings.PYTHON_SWITCH_INTERVAL_S = 0.0005
    daphne, calls = recorded
    install_all()
    services = calls[2]
    assert calls == [
        ("install_http_guard", daphne.server),
        ("install_direct_writes",),
        ("loop.call_soon", services[1]),  # the services' task, made on the loop's first turn
        ("sys.setswitchinterval", 0.0005),
        ("install_state_dump", daphne.loop),
        ("install_loop_monitor", daphne.loop),
        ("install_memory_return",),
        ("log_queue.install",),
        ("install_access_log", daphne.reactor),
        ("loop.call_soon", no_delay_on_listening_sockets, daphne.reactor),
        ("reactor.addSystemEventTrigger", "before", "shutdown", hooks._close_worker_transport),
        ("install_drain", daphne.reactor),
    ]


def test_direct_writes_only_when_on(recorded: tuple[Daphne, list[tuple[Any, ...]]], settings: Any) -> None:
    settings.GATEWAY_DIRECT_WRITES = False
    _, calls = recorded
    install_all()
    assert "install_direct_writes" not in [call[0] for call in calls]


async def test_the_services_start_before_the_collector_is_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the services' hook schedules on the loop's first turn."""
    started: list[str] = []
    monkeypatch.setattr(hooks, "start_services", lambda: started.append("services"))
    monkeypatch.setattr(gc_tuning, "install", lambda: started.append("gc tuning"))
    await hooks._start()
    assert started == ["services", "gc tuning"]


def test_nothing_is_installed_without_daphne(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "running_daphne", lambda: None)
    installed: list[str] = []
    install_all([Hook("probe", lambda daphne: installed.append("probe"))])
    assert installed == []


def test_daphne_is_its_server_module_with_twisteds_asyncio_reactor(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = object()
    AsyncioSelectorReactor = type("AsyncioSelectorReactor", (), {"_asyncioEventloop": loop})
    server = types.ModuleType("daphne.server")
    reactor = AsyncioSelectorReactor()
    monkeypatch.setitem(sys.modules, "daphne.server", server)
    monkeypatch.setitem(sys.modules, "twisted.internet.reactor", reactor)
    assert running_daphne() == Daphne(server, reactor, loop)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "twisted.internet.reactor", type("EPollReactor", (), {})())
    assert running_daphne() is None
    monkeypatch.delitem(sys.modules, "daphne.server")
    monkeypatch.setitem(sys.modules, "twisted.internet.reactor", reactor)
    assert running_daphne() is None


def test_tcp_nodelay_is_set_on_listening_tcp_ports_only() -> None:
    Port = type("Port", (), {})
    Other = type("Client", (), {})
    tcp_port, tcp_other, unix_port = Port(), Other(), Port()
    tcp_port.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp_other.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    unix_port.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    reactor = type("Reactor", (), {"getReaders": lambda self: [tcp_port, tcp_other, unix_port, Port()]})()
    try:
        no_delay_on_listening_sockets(reactor)
        assert tcp_port.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert not tcp_other.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        for reader in (tcp_port, tcp_other, unix_port):
            reader.socket.close()
