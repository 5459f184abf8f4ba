"""What a client can put in the gateway's log, against a real daphne process and its log: a bad Host
is one short sampled line (messages_api/host_check.py), never a traceback per request; the
client's text in the access log (the model, an error message quoting it) is escaped
(messages_api/request_context.loggable)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.cluster import wait_until
from tests.support.conversation import exchange
from tests.support.gateway import Gateway
from tests.support.prometheus import metric_value

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def quiet_gateway(gateways: Callable[..., Gateway]) -> Gateway:
    """A gateway of this module's own, so that its log holds only these tests' lines."""
    return gateways(LOG_LEVEL="INFO", AUDIT_FLUSH_INTERVAL_S="0.02")


def log_after(gateway: Gateway, offset: int) -> str:
    return gateway.log(None)[offset:]


def test_bad_host_rejections_are_one_sampled_line_without_a_traceback(quiet_gateway: Gateway) -> None:
    offset = len(quiet_gateway.log(None))
    started = time.monotonic()
    for i in range(30):
        answer = exchange(quiet_gateway, f"GET /anything HTTP/1.1\r\nhost: evil-{i}.example\r\n\r\n".encode(), wait_close=0)
        assert answer.status == 400
        assert answer.envelope() == {"type": "invalid_request_error", "message": "The Host header is not a host this gateway serves"}
    elapsed = time.monotonic() - started
    assert metric_value(httpx.get(quiet_gateway.url + "/metrics", timeout=5).text, "gateway_bad_host_rejections_total") == 30.0
    time.sleep(0.3)
    log = log_after(quiet_gateway, offset)
    assert "Traceback" not in log and "DisallowedHost" not in log
    lines = [line for line in log.splitlines() if "not in ALLOWED_HOSTS" in line]
    # AUDIT_UNAUTHENTICATED_SAMPLE_PER_S (1 a second by default): the first, then about one a second.
    assert 1 <= len(lines) <= elapsed + 2, lines
    assert all(len(line) < 300 for line in lines), lines
    assert "evil-0.example" in lines[0]


def test_the_client_s_text_is_escaped_in_the_access_log(quiet_gateway: Gateway, transactional_db: Any) -> None:
    from messages_api.auth import create_api_key

    _, key = create_api_key("log-hygiene")
    forged = "2026-01-01 00:00:00,000 INFO messages_api.access [req_forged] admin stream=False status=completed"
    model = f"evil\n{forged}\r\x1b[2J\x1b[31mred\u2028"
    offset = len(quiet_gateway.log(None))
    response = httpx.post(
        quiet_gateway.url + "/v1/messages",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert response.status_code == 404  # no such model: the error message quotes it too
    request_id = response.headers["request-id"]
    line = wait_until(
        lambda: next((ln for ln in log_after(quiet_gateway, offset).splitlines() if request_id in ln and "messages_api.access" in ln), None),
        timeout=5, message="no access log line",
    )
    log = log_after(quiet_gateway, offset)
    assert "\x1b" not in log and "\u2028" not in log
    assert not any(ln.startswith(forged) for ln in log.splitlines())  # no line forged by the client
    assert "evil\\n2026-01-01" in line and "\\x1b[2J\\x1b[31mred\\u2028" in line
    assert line.count("evil\\n") == 2  # the model, and the error message quoting it


def test_daphnes_access_lines_go_through_the_log_thread(quiet_gateway: Gateway) -> None:
    # daphne writes its own access line to stdout on the event loop; the gateway hands it to the
    # logging thread instead (messages_api/server/access_log.py). (A control character in the
    # path never gets that far: the intake guard refuses the request line, 400.)
    offset = len(quiet_gateway.log(None))
    assert httpx.get(quiet_gateway.url + "/v1/nothing", timeout=5).status_code == 404
    assert httpx.get(quiet_gateway.url + "/health", timeout=5).status_code == 200
    line = wait_until(
        lambda: next((ln for ln in log_after(quiet_gateway, offset).splitlines() if '"GET /health" 200' in ln), None),
        timeout=5, message="no access line for /health",
    )
    assert " INFO messages_api.server.access_log " in line and "127.0.0.1:" in line
    log = log_after(quiet_gateway, offset)
    assert '"GET /v1/nothing" 404' in log
    assert " - - [" not in log  # daphne's own stdout line (NCSA format) is gone
