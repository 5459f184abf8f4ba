"""`/health`, the liveness probe: an ASGI application the router sends the path to before Django.

Liveness must answer while the gateway is busiest. A request through Django's ASGI handler starts
a thread (its thread-sensitive context) and hands work to threads twice more (the request
signals), and on a loaded machine each of those waits for the OS to schedule a thread: under a
1,000-stream burst the probe's p99 through Django was 56-121 ms, its targets 50
(bench/results/2026-12-06-burst.md). This answers in one step on the event loop, for any Host
(load balancers address a backend by its IP), over plain HTTP (no HTTPS redirect), as the other
probes do (messages_api/probes.py).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["health"]

_BODY = orjson.dumps({"status": "ok"})
_SAFE_METHODS = ("GET", "HEAD")


async def health(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Liveness: the process answers (GET or HEAD; another method is a 405)."""
    method = scope.get("method", "GET")
    if method in _SAFE_METHODS:
        status, body = 200, _BODY
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    else:
        status, body = 405, b""
        headers = [(b"allow", b"GET, HEAD"), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
