"""daphne's access log, written off the event loop with the gateway's other lines.

daphne's command line writes one access line per HTTP request to stdout itself
(`daphne.access.AccessLogGenerator`, on at its default verbosity): formatted, and written with a
blocking `write` system call, on the event loop thread. Under systemd stdout is a stream to the
journal; a journal that falls behind would stop the loop, which is why the gateway's own lines go
through disagg_project/log_queue.py. `install(reactor)` hands the same line to this module's
logger instead: the loop only enqueues it, the log thread writes it with the others (timestamped
by the log format, the client's path escaped as client text is everywhere in the logs).

An operator's `daphne --access-log FILE` is left as it is: only the generator daphne writes to
stdout by default is replaced.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from messages_api.request_context import loggable

__all__ = ["install", "log_action"]

logger = logging.getLogger(__name__)


def log_action(protocol: str, action: str, details: dict[str, Any]) -> None:
    """daphne's action-logger interface (`Server.log_action`): a completed HTTP request's line,
    as daphne writes it (client, request line, status, bytes sent). WebSockets are not served."""
    if protocol == "http" and action == "complete":
        logger.info(
            '%s "%s %s" %s %s',
            details.get("client") or "-", details.get("method"), loggable(str(details.get("path"))),
            details.get("status") or "-", details.get("size") or "-",
        )


def install(reactor: Any) -> None:
    """Once the reactor runs (daphne's ports are listening by then), route each daphne server's
    stdout access log through `log_action`."""
    reactor.callWhenRunning(_replace_stdout_generators, reactor)


def _replace_stdout_generators(reactor: Any) -> None:
    from daphne.access import AccessLogGenerator

    from messages_api.server.drain import listening_ports

    for port in listening_ports(reactor):
        server = port.factory.server
        generator = server.action_logger
        if isinstance(generator, AccessLogGenerator) and generator.stream is sys.stdout:
            server.action_logger = log_action
