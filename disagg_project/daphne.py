"""What a gateway process installs around daphne besides the application: its hooks, in order
(`HOOKS`), each with why it is there, and `install_all()`, which disagg_project/asgi.py calls.

Daphne's command line imports the application before `Server.run()` builds its HTTP factory,
listens and runs the reactor. A hook installed then can change what daphne builds (its factory,
the class of an accepted connection), set what the process runs with (signal handlers, the GIL's
switch interval, the allocator, the log handlers), and schedule what runs once the reactor does
(on the loop's first turn, `callWhenRunning`, at shutdown). Every hook has the same signature:
`install(daphne: Daphne)`; the order of `HOOKS` is the order they are installed in.

`install_all()` installs them when daphne's server module and its asyncio reactor are loaded.
`daphne` is an installed app, whose import loads both, so that holds in every process that loads
this application: under another ASGI server the hooks that wait for the reactor never run.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, NamedTuple, Protocol

from django.conf import settings
from twisted.internet.defer import Deferred

from disagg_project import gc_tuning, log_queue, telemetry
from messages_api import (
    install_access_log,
    install_direct_writes,
    install_drain,
    install_http_guard,
    install_loop_monitor,
    install_memory_return,
    install_state_dump,
    start_batch_runner,
)
from workers import close_transport, start_services

__all__ = ["Daphne", "Hook", "HOOKS", "install_all", "running_daphne"]


class Reactor(Protocol):
    """What the hooks here use of Twisted's reactor (the asyncio one daphne installs)."""

    def getReaders(self) -> list[Any]: ...
    def addSystemEventTrigger(self, phase: str, event_type: str, call: Callable[[], object]) -> object: ...


class Daphne(NamedTuple):
    """The daphne a hook is installed into."""

    server: ModuleType  # `daphne.server`, whose globals `Server.run()` reads
    reactor: Reactor  # Twisted's AsyncioSelectorReactor
    loop: asyncio.AbstractEventLoop  # the loop that reactor runs: the applications' loop


class Hook(NamedTuple):
    """One hook: its name, and how it is installed into daphne."""

    name: str
    install: Callable[[Daphne], None]


# --- the hooks that are more than a call (the others call their module's `install` directly) ---


def _guard_http_intake(daphne: Daphne) -> None:
    install_http_guard(daphne.server)


def _direct_writes(daphne: Daphne) -> None:
    if settings.GATEWAY_DIRECT_WRITES:
        install_direct_writes()


def _services_on_first_turn(daphne: Daphne) -> None:
    loop = daphne.loop
    loop.call_soon(lambda: loop.create_task(_start()))


async def _start() -> None:
    start_services()
    start_batch_runner()  # Message Batches' items, claimed from the database (messages_api/batches/)
    gc_tuning.install()


def _switch_interval(daphne: Daphne) -> None:
    sys.setswitchinterval(settings.PYTHON_SWITCH_INTERVAL_S)


def _no_delay_on_first_turn(daphne: Daphne) -> None:
    daphne.loop.call_soon(no_delay_on_listening_sockets, daphne.reactor)


def no_delay_on_listening_sockets(reactor: Reactor) -> None:
    """TCP_NODELAY on every listening TCP socket of the reactor's (Linux copies it from a listening
    socket to the connections it accepts)."""
    for reader in reactor.getReaders():
        sock = getattr(reader, "socket", None)
        if reader.__class__.__name__ == "Port" and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _close_transport_at_shutdown(daphne: Daphne) -> None:
    daphne.reactor.addSystemEventTrigger("before", "shutdown", _close_worker_transport)


def _close_worker_transport() -> Deferred[None]:
    return Deferred.fromFuture(asyncio.ensure_future(close_transport()))


# --- the hooks, in order ------------------------------------------------------------------------

HOOKS: tuple[Hook, ...] = (
    # What daphne builds: changed at import, before `Server.run()` builds its factory and accepts
    # a connection.
    #
    # Daphne's HTTP factory replaced by one whose channels bound what a client sends while Twisted
    # parses it (size, read deadline, what the headers decide) and answer in Anthropic's envelope
    # (messages_api/server/http_guard.py).
    Hook("http guard", _guard_http_intake),
    # Every accepted connection writes to its socket at once when nothing is queued before, instead
    # of on the loop's next turn (messages_api/server/direct_write.py); GATEWAY_DIRECT_WRITES=0
    # keeps Twisted's transport.
    Hook("direct writes", _direct_writes),
    #
    # The cluster's background services (registry refresh, health probes, heartbeat and crash
    # recovery) and the front door's batch runner (messages_api/batches/runner.py: it claims
    # Message Batches' items while the admission queue has room) start on the loop's first turn: daphne has no ASGI lifespan, and they must not wait
    # for a first request. The garbage collector's tuning follows them in the same task: by the
    # loop's first turn all of start-up has loaded, which it freezes out of the collector's reach
    # (disagg_project/gc_tuning.py). Put on the loop's queue ahead of TCP_NODELAY below.
    Hook("background services and the batch runner, then the collector's tuning", _services_on_first_turn),
    #
    # What the process runs with, set now. None depends on another; the order is the one they
    # were added in.
    #
    # The GIL's switch interval shortened (PYTHON_SWITCH_INTERVAL_S): the loop thread waits for the
    # GIL behind the thread that parses large bodies after every select, send and recv, for up to
    # the interval each time.
    Hook("switch interval", _switch_interval),
    # `kill -USR1`: every thread's stack and every task's await chain to the log
    # (messages_api/server/state_dump.py).
    Hook("state dump", lambda daphne: install_state_dump(daphne.loop)),
    # The loop's lag measured, and new API requests shed while it is over GATEWAY_SHED_LOOP_LAG_S
    # (messages_api/server/loop_lag.py).
    Hook("loop monitor", lambda daphne: install_loop_monitor(daphne.loop)),
    # glibc's mmap threshold pinned, so large requests' memory goes back to the system
    # (messages_api/server/memory.py).
    Hook("memory return", lambda daphne: install_memory_return()),
    # Log records formatted and written on a thread of their own, not on the loop
    # (disagg_project/log_queue.py).
    Hook("log queue", lambda daphne: log_queue.install()),
    # OpenTelemetry tracing, when the OTEL_* environment asks for it (disagg_project/telemetry.py):
    # its batch processor's export thread starts here, before any request.
    Hook("tracing", lambda daphne: telemetry.install()),
    #
    # What is scheduled for later: when the reactor starts (`callWhenRunning`, before the loop's
    # first turn), on the loop's first turn, at shutdown.
    #
    # Daphne's stdout access lines handed to a logger, so they go through the log queue above
    # (messages_api/server/access_log.py); replaced once the reactor runs, when daphne's servers
    # exist.
    Hook("access log", lambda daphne: install_access_log(daphne.reactor)),
    # TCP_NODELAY on daphne's listening sockets, on the loop's first turn (they listen by then):
    # Twisted leaves Nagle's algorithm on, and an SSE frame written while the previous one is
    # unacknowledged would wait for the client's delayed ACK.
    Hook("TCP_NODELAY", _no_delay_on_first_turn),
    # The worker connection pools closed at shutdown while the loop still runs (after daphne has
    # stopped the applications), instead of being left to be collected.
    Hook("worker transport closed at shutdown", _close_transport_at_shutdown),
    # SIGTERM taken over from Twisted to drain the requests in flight
    # (messages_api/server/drain.py): once the reactor runs, since Twisted installs its own
    # handlers while it starts. Nothing is installed with GATEWAY_DRAIN_TIMEOUT_S=0.
    Hook("drain", lambda daphne: install_drain(daphne.reactor)),
)


def install_all(hooks: Iterable[Hook] = HOOKS) -> None:
    """Install `hooks`, in order, into this process's daphne (`running_daphne()`); without one,
    nothing."""
    daphne = running_daphne()
    if daphne is None:
        return
    for hook in hooks:
        hook.install(daphne)


def running_daphne() -> Daphne | None:
    """The daphne of this process, when its server module and asyncio reactor are loaded."""
    server = sys.modules.get("daphne.server")
    # Installing a reactor puts the reactor itself, not a module, in sys.modules.
    reactor: Any = sys.modules.get("twisted.internet.reactor")
    if server is None or reactor is None or type(reactor).__name__ != "AsyncioSelectorReactor":
        return None
    # The loop daphne runs: a Twisted internal (disagg_project/relied_on.py).
    return Daphne(server, reactor, reactor._asyncioEventloop)
