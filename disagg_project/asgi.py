"""ASGI entry point: the API routes go to the Channels consumers, everything else to Django."""

import asyncio
import os
import socket
import sys

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

from disagg_project import gc_tuning, login_guard  # noqa: E402
from messages_api import http_application, start_batch_runner  # noqa: E402
from workers import start_services  # noqa: E402

# Django's side first answers the admin logins of clients locked out (disagg_project/login_guard.py).
application = ProtocolTypeRouter({"http": http_application(login_guard.guard(django_asgi_app))})


def _start_services_with_daphne() -> None:
    """Under daphne (its asyncio reactor is installed before the application is loaded) start the
    background services now: heartbeat and crash recovery must not wait for a first request."""
    reactor = sys.modules.get("twisted.internet.reactor")
    if reactor is None or type(reactor).__name__ != "AsyncioSelectorReactor":
        return
    loop = reactor._asyncioEventloop  # the loop daphne runs (a Twisted internal: disagg_project/relied_on.py)
    loop.call_soon(lambda: loop.create_task(_start()))
    from messages_api import install_loop_monitor, install_memory_return, install_state_dump

    # A large body is parsed, validated and converted on a thread, which holds the GIL for up to
    # the switch interval each time the loop thread wants it back (after every select, send and
    # recv): at the default 5 ms a 20,000-block request kept /health waiting 0.6 s at p50
    # (bench/large_requests.py). A shorter interval bounds each wait.
    from django.conf import settings

    sys.setswitchinterval(settings.PYTHON_SWITCH_INTERVAL_S)
    install_state_dump(loop)  # kill -USR1: thread and task stacks to the log
    install_loop_monitor(loop)  # new API requests are shed while the loop lags
    install_memory_return()  # large requests' memory goes back to the system
    from disagg_project import log_queue

    log_queue.install()  # log lines formatted and written on a thread of their own
    from messages_api import install_access_log

    install_access_log(reactor)  # and daphne's access lines with them, not on stdout from the loop
    loop.call_soon(_no_delay_on_listening_sockets, reactor)
    # Close the worker connection pools while the loop still runs (after daphne has stopped the
    # applications), instead of leaving them to be collected.
    reactor.addSystemEventTrigger("before", "shutdown", _close_worker_transport)
    from messages_api import install_drain

    install_drain(reactor)


def _close_worker_transport() -> object:
    from twisted.internet.defer import Deferred

    from workers import close_transport

    return Deferred.fromFuture(asyncio.ensure_future(close_transport()))


def _no_delay_on_listening_sockets(reactor: object) -> None:
    """Twisted leaves Nagle's algorithm on: an SSE frame written while the previous one is
    unacknowledged can wait ~40 ms for a delayed ACK. Linux copies TCP_NODELAY from a listening
    socket to the connections it accepts."""
    for reader in reactor.getReaders():  # type: ignore[attr-defined]
        sock = getattr(reader, "socket", None)
        if reader.__class__.__name__ == "Port" and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _start() -> None:
    start_services()
    start_batch_runner()  # Message Batches' items, claimed from the database (messages_api/batches/)
    gc_tuning.install()


def _guard_http_intake() -> None:
    """Under daphne (its command line imports this module before it runs the server) bound what a
    client sends while daphne parses it: body limit, read deadline, errors in Anthropic's
    envelope (messages_api/server/http_guard.py)."""
    daphne_server = sys.modules.get("daphne.server")
    if daphne_server is None:
        return
    from messages_api import install_http_guard

    install_http_guard(daphne_server)
    from django.conf import settings

    if settings.GATEWAY_DIRECT_WRITES:
        from messages_api import install_direct_writes

        install_direct_writes()


_guard_http_intake()
_start_services_with_daphne()
