"""messages_api/liveness.py: `/health` is answered by the router before Django (no thread, no
hop), for GET and HEAD, and refuses other methods."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from channels.testing import ApplicationCommunicator

from messages_api.routes import http_application
from tests.support.communicator import read_response


async def django_must_not_answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    raise AssertionError(f"{scope['path']} reached Django")


def scope(method: str, path: str = "/health") -> dict[str, Any]:
    return {
        "type": "http", "http_version": "1.1", "method": method, "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": [(b"host", b"10.20.30.40:8000")],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }


async def answer(method: str) -> tuple[int, dict[bytes, bytes], bytes]:
    communicator = ApplicationCommunicator(http_application(django_must_not_answer), scope(method))
    await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
    try:
        return await read_response(communicator)
    finally:
        await communicator.wait(10)


async def test_health_is_answered_before_django_for_any_host() -> None:
    status, headers, body = await answer("GET")
    assert status == 200 and orjson.loads(body) == {"status": "ok"}
    assert headers[b"content-type"] == b"application/json" and int(headers[b"content-length"]) == len(body)


async def test_a_head_has_the_gets_headers_and_no_body() -> None:
    status, headers, body = await answer("HEAD")
    assert status == 200 and body == b"" and int(headers[b"content-length"]) == len(b'{"status":"ok"}')


@pytest.mark.parametrize("method", ["POST", "DELETE"])
async def test_another_method_is_refused(method: str) -> None:
    status, headers, body = await answer(method)
    assert status == 405 and headers[b"allow"] == b"GET, HEAD" and body == b""


async def test_other_paths_still_go_to_django() -> None:
    communicator = ApplicationCommunicator(http_application(django_must_not_answer), scope("GET", "/healthz"))
    await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
    with pytest.raises(AssertionError, match="reached Django"):
        await communicator.wait(10)
