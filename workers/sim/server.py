"""Running a SimApp under uvicorn in this process, announcing the bound address."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import replace

import uvicorn

from .app import SimApp
from .config import SimConfig
from .error_answers import SimulatedDrop

BACKLOG = 4096


class _HideExpectedExits(logging.Filter):
    """uvicorn logs any exception leaving the app; a simulated drop, or a stream cancelled
    because the worker is shutting down, is not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (SimulatedDrop, asyncio.CancelledError))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    # Accepted connections inherit it (Linux): without it a keep-alive request can wait ~40 ms
    # for a delayed ACK, which a real worker's server does not add.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def build_server(config: SimConfig, sock: socket.socket) -> tuple[SimApp, uvicorn.Server]:
    app = SimApp(replace(config, port=sock.getsockname()[1]))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http="httptools",
            loop="asyncio",
            lifespan="on",
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            timeout_keep_alive=30,
            # A stream may be minutes long; on SIGTERM cut it after a moment instead.
            timeout_graceful_shutdown=2,
            backlog=BACKLOG,
        )
    )
    # After uvicorn.Config: it (re)configures logging when constructed.
    logging.getLogger("uvicorn.error").addFilter(_HideExpectedExits())
    return app, server


async def _serve(server: uvicorn.Server, sock: socket.socket, on_listening: Callable[[], None]) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task  # startup failed: surface why
            return
        await asyncio.sleep(0.005)
    on_listening()
    await task


def serve(config: SimConfig, announce: Callable[[str], None]) -> None:
    """Serves until SIGINT/SIGTERM; calls `announce` with the listening line once ready."""
    sock = bind(config.host, config.port)
    app, server = build_server(config, sock)
    host = f"[{config.host}]" if ":" in config.host else config.host
    line = f"simworker {config.role} listening on http://{host}:{app.config.port}"
    try:
        asyncio.run(_serve(server, sock, lambda: announce(line)))
    except KeyboardInterrupt:
        # uvicorn re-raises the signal it shut down on; Ctrl-C is a normal way to stop.
        pass
