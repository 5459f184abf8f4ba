"""Daphne's request behind an ASGI `send`: what the writers that bypass `send` write to.

Daphne's `Server.create_application` binds each application's `send` to its request:
`functools.partial(server.handle_reply, request)`, the request a `twisted.web.http.Request`
(daphne's `WebRequest`) whose `server` is that server. `daphne_request(send)` returns that request,
or None for any other `send` (another server, an in-process test), so its callers fall back to the
ASGI path. The names it reads are listed in disagg_project/relied_on.py (checked by
tests/unit/disagg_project/test_relied_on.py).
"""

from __future__ import annotations

import functools
from typing import Any

from twisted.web import http


def daphne_request(send: Any) -> Any | None:
    """The daphne request `send` answers, or None when `send` is not daphne's."""
    if not isinstance(send, functools.partial) or len(send.args) != 1 or send.keywords:
        return None
    handle_reply = send.func
    server: Any = getattr(handle_reply, "__self__", None)
    request: Any = send.args[0]
    if (
        getattr(handle_reply, "__name__", None) != "handle_reply"
        or type(server).__module__ != "daphne.server"
        or not isinstance(request, http.Request)
        or getattr(request, "server", None) is not server
    ):
        return None
    return request


__all__ = ["daphne_request"]
