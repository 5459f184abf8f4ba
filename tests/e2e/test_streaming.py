"""Streamed `POST /v1/messages` against a real daphne and real sim workers, in both schedule
orders (the `cluster` fixture is parametrised over them).

The gateways here run with MESSAGES_STREAM_START_WAIT_S=0.3 and MESSAGES_PING_INTERVAL_S=0.5
(tests/support/gateway.py), so "slow" means a context phase of a second or two.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest

from tests.support.cluster import (
    Cluster,
    audit_row,
    reservations_closed,
    wait_registered,
    wait_until,
)
from tests.support.gateway import PING_INTERVAL, START_WAIT, Gateway
from tests.support.rawclient import RawStream


def stream(gateway: Gateway, cluster: Cluster, text: str, **body: Any) -> RawStream:
    payload = {
        "model": cluster.model,
        "max_tokens": 256,
        "stream": True,
        "messages": [{"role": "user", "content": text}],
        **body,
    }
    return RawStream.post_json(gateway.url + "/v1/messages", payload, cluster.headers())


def content_events(frames: list[Any]) -> list[str]:
    return [f.event for f in frames if f.event != "ping"]


def assert_complete_message(frames: list[Any]) -> None:
    events = content_events(frames)
    assert events[0] == "message_start", events
    assert events[-2:] == ["message_delta", "message_stop"], events
    assert "error" not in events
    assert frames[[f.event for f in frames].index("message_start")].data["message"]["usage"]["input_tokens"] > 0


# --- answered within the wait ----------------------------------------------------------------------


def test_fast_success_relays_the_reframed_stream(gateway: Gateway, cluster: Cluster) -> None:
    s = stream(gateway, cluster, "Tell me something [sim tokens=6]")
    frames = s.read_all()
    assert s.status == 200
    assert s.response_headers["content-type"].startswith("text/event-stream")
    assert s.response_headers["request-id"].startswith("req_")
    assert_complete_message(frames)
    deltas = [f.data["delta"]["text"] for f in frames if f.event == "content_block_delta"]
    assert len(deltas) == 6
    stop = next(f for f in frames if f.event == "message_delta")
    assert stop.data["delta"]["stop_reason"] == "end_turn" and stop.data["usage"]["output_tokens"] == 6
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "completed" and row.stream and row.stage == "done"
    assert row.headers_sent_ms is not None and row.first_token_ms is not None
    assert {r.outcome for r in reservations_closed(row.request_id)} == {"success"}


def test_fast_start_with_a_slow_first_token_still_sends_the_status_line(
    gateways: Callable[..., Gateway], cluster: Cluster
) -> None:
    """The generation stream opens within the wait (its headers arrive) but its first chunk
    takes longer: the status line must leave by the end of the wait, not with the first chunk or
    the first ping a whole interval later."""
    gateway = gateways(MESSAGES_PING_INTERVAL_S="5")
    wait_registered(gateway, cluster)
    s = stream(gateway, cluster, "slow first token [sim gen_delay=2 tokens=2]")
    assert s.read_head() == 200
    assert s.head_at is not None and s.head_at < START_WAIT + 0.3
    frames = s.read_all()
    assert_complete_message(frames)


@pytest.mark.parametrize("status", [400, 503])
def test_fast_failure_keeps_http_status_and_body(gateway: Gateway, cluster: Cluster, status: int) -> None:
    s = stream(gateway, cluster, f"hi [sim context_status={status}]")
    body = s.body_json()
    assert s.status == status
    assert s.response_headers["content-type"] == "application/json"
    assert body["type"] == "error"
    assert body["error"]["type"] == {400: "invalid_request_error", 503: "overloaded_error"}[status]
    row = audit_row(body["request_id"])
    assert row.status == "failed" and row.http_status == status and row.stage == "context"


def test_over_length_prompt_is_anthropic_wording(gateway: Gateway, cluster: Cluster) -> None:
    s = stream(gateway, cluster, "word " * 5000)
    body = s.body_json()
    assert s.status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long: ")
    assert body["error"]["message"].endswith(" tokens > 4096 maximum")


# --- started before the context phase ended ------------------------------------------------------


def test_slow_context_starts_at_once_and_pings(gateway: Gateway, cluster: Cluster) -> None:
    s = stream(gateway, cluster, "slow one [sim context_delay=1.6 tokens=3]")
    assert s.read_head() == 200
    # The status line is on the wire right after the wait, long before the context phase ends.
    assert s.head_at is not None and s.head_at < START_WAIT + 0.5
    frames = s.read_all()
    assert_complete_message(frames)
    events = [f.event for f in frames]
    before_start = events[: events.index("message_start")]
    assert before_start and set(before_start) == {"ping"}
    assert len(before_start) >= 3  # the first at once, then one every 0.5 s of silence
    # No silent gap longer than the interval (plus scheduling slack) before message_start.
    times = [0.0] + [f.at for f in frames[: events.index("message_start") + 1]]
    assert max(b - a for a, b in itertools.pairwise(times[1:])) < PING_INTERVAL + 0.3
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "completed"
    assert row.pings_sent >= 3
    assert row.headers_sent_ms < (START_WAIT + 0.5) * 1000
    assert row.context_done_ms >= 1600 and row.first_token_ms >= row.context_done_ms


@pytest.mark.parametrize("status", [400, 503])
def test_late_failure_is_an_error_event_with_the_http_message(gateway: Gateway, cluster: Cluster, status: int) -> None:
    fast = stream(gateway, cluster, f"hi [sim context_status={status}]").body_json()
    s = stream(gateway, cluster, f"hi [sim context_delay=1 context_status={status}]")
    assert s.read_head() == 200
    frames = s.read_all()
    events = [f.event for f in frames]
    assert events[-1] == "error" and "message_stop" not in events and "message_start" not in events
    error = frames[-1].data
    assert error["type"] == "error"
    assert error["error"] == fast["error"]  # same type, exactly the same message
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "failed" and row.stage == "context" and row.error_message == fast["error"]["message"]
    assert {r.outcome for r in reservations_closed(row.request_id)} == {"failure"}


def test_generation_worker_dying_mid_stream(gateway: Gateway, cluster: Cluster) -> None:
    s = stream(gateway, cluster, "hi [sim tokens=50 gen_fail_after=3]")
    frames = s.read_all()
    events = [f.event for f in frames]
    assert events[0] == "message_start" and events[-1] == "error"
    assert "message_stop" not in events and "message_delta" not in events
    # The open text block was closed before the error.
    assert events[-2] == "content_block_stop"
    assert frames[-1].data["error"]["type"] == "api_error"
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "failed" and row.stage == "generation"
    outcomes = {r.stage: r.outcome for r in reservations_closed(row.request_id)}
    assert outcomes == {"context": "success", "generation": "failure"}


# --- the client goes away ----------------------------------------------------------------------------


def assert_cancelled(cluster: Cluster, request_id: str, stage: str) -> None:
    row = audit_row(request_id)
    assert row.status == "cancelled" and row.stage == stage, (row.status, row.stage)
    rows = reservations_closed(request_id)
    released = {r.stage: r.outcome for r in rows}
    assert released.get(stage) == "cancelled", released
    assert len({r.reservation_id for r in rows}) == len(rows)


def request_id_since(moment: datetime) -> str:
    """The id of the request received after `moment` (its headers have not been sent yet)."""
    from messages_api.models import MessageRequest

    return wait_until(
        lambda: MessageRequest.objects.filter(received_at__gte=moment).values_list("request_id", flat=True).first()
    )


def test_disconnect_during_the_wait_cancels_the_context_call(gateway: Gateway, cluster: Cluster) -> None:
    started = datetime.now(timezone.utc)
    s = stream(gateway, cluster, "abandon me [sim context_delay=30]")
    cluster.context.wait_for(lambda st: st["active"] == 1)
    request_id = request_id_since(started)
    s.close()  # before the gateway's start wait is over: no status line was sent yet
    cluster.context.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    assert_cancelled(cluster, request_id, "context")
    assert cluster.context.stats()["kv_held"] == 0
    cluster.generation.wait_for(lambda st: st["active"] == 0)


def test_disconnect_after_headers_before_first_event(gateway: Gateway, cluster: Cluster) -> None:
    s = stream(gateway, cluster, "abandon me later [sim context_delay=30]")
    assert s.read_head() == 200
    s.read_until("ping")
    s.close()
    cluster.context.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    assert_cancelled(cluster, s.response_headers["request-id"], "context")
    cluster.generation.wait_for(lambda st: st["active"] == 0)


def test_disconnect_mid_stream_stops_generation(gateway: Gateway, cluster: Cluster) -> None:
    s = stream(gateway, cluster, "long answer [sim tokens=20000]")
    s.read_until("content_block_delta")
    s.close()
    cluster.generation.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    assert_cancelled(cluster, s.response_headers["request-id"], "generation")
    assert {r.stage: r.outcome for r in reservations_closed(s.response_headers["request-id"])}["context"] == "success"
    assert cluster.context.stats()["kv_held"] == 0


def test_disconnect_before_the_body_is_complete(gateway: Gateway, cluster: Cluster) -> None:
    from messages_api.models import MessageRequest

    s = RawStream(gateway.url + "/v1/messages", b'{"model": "sim-model", "max_tokens": 5, ', {**cluster.headers(), "content-length": "4096"})
    s.close()
    # Nothing reached a worker and no audit row was opened.
    s2 = stream(gateway, cluster, "after [sim tokens=1]")
    s2.read_all()
    assert cluster.context.stats()["received"] == 1
    audit_row(s2.response_headers["request-id"])
    assert MessageRequest.objects.count() == 1
