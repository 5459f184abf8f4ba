"""The front door's error boundary end to end: a stream that breaks after its status line always
ends with an `error` event and a closed response, the whole-request deadline, and a failed
request's one audit row — against a real daphne, real sim workers and a scripted bad worker."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, audit_row, reservations_closed, wait_registered
from tests.support.fakeworker import ScriptedWorker, chunk
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "fake-model"
DEADLINE_S = 1.5


def register_fake(context: SimWorker, generation: ScriptedWorker) -> Cluster:
    """A pool whose prompts all skip the context phase (`max_local_prefill_tokens`), so each
    request goes straight to the scripted generation worker."""
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(name=f"pool-{MODEL}", model=MODEL, max_local_prefill_tokens=100_000)
    WorkerEndpoint.objects.create(pool=pool, role="context", url=context.url)
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=generation.url)
    _, key = create_api_key(f"test-key-{time.monotonic_ns()}")
    return Cluster(pool=pool, key=key, model=MODEL, context=context, generation=generation)  # type: ignore[arg-type]


@pytest.fixture
def bad_worker(request: pytest.FixtureRequest) -> Iterator[ScriptedWorker]:
    frames, then = request.param
    with ScriptedWorker(frames, then=then) as worker:
        yield worker


@pytest.fixture
def fake_cluster(transactional_db: Any, gateway: Gateway, context_worker: SimWorker, bad_worker: ScriptedWorker) -> Cluster:
    cluster = register_fake(context_worker, bad_worker)
    wait_registered(gateway, cluster)
    return cluster


def send(gateway: Gateway, cluster: Cluster, text: str, *, stream: bool) -> RawStream:
    payload = {"model": cluster.model, "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": text}]}
    return RawStream.post_json(gateway.url + "/v1/messages", payload, cluster.headers())


GOOD_START = chunk({"role": "assistant", "content": "Hello"})
# Valid JSON of a shape no engine sends: today the reframer trips over it (a bug path); once the
# worker boundary validates chunks it is a WorkerError. Either way the stream must end properly.
MALFORMED = [GOOD_START, b"data: 5\n\n"]
BROKEN_JSON = [GOOD_START, b"data: {not json\n\n"]


def assert_ended_with_error(s: RawStream, error_type: str) -> dict[str, Any]:
    frames = s.read_all(timeout=10)  # raises unless the response is closed (chunked terminator)
    assert s.status == 200 and s.ended
    events = [f.event for f in frames if f.event != "ping"]
    assert events[0] == "message_start", events
    assert events[-1] == "error", events
    assert "message_stop" not in events and "message_delta" not in events
    error = frames[-1].data
    assert error["type"] == "error" and error["error"]["type"] == error_type
    assert "127.0.0.1" not in str(error) and "Traceback" not in str(error)
    return error


@pytest.mark.parametrize("bad_worker", [(MALFORMED, "hang"), (BROKEN_JSON, "hang")], indirect=True, ids=["shape", "json"])
def test_a_bad_chunk_after_the_status_line_ends_the_stream(gateway: Gateway, fake_cluster: Cluster, bad_worker: ScriptedWorker) -> None:
    s = send(gateway, fake_cluster, "hi", stream=True)
    assert s.read_head() == 200
    assert_ended_with_error(s, "api_error")
    # The worker's connection is given up, not left to hang with the client's.
    bad_worker.wait_for_hang_up()
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "failed" and row.http_status == 200 and row.stage == "generation"
    assert row.error_type == "api_error" and row.error_message
    assert {r.outcome for r in reservations_closed(row.request_id)} == {"failure"}


@pytest.mark.parametrize("bad_worker", [(MALFORMED, "hang"), (BROKEN_JSON, "hang")], indirect=True, ids=["shape", "json"])
def test_a_bad_chunk_non_streamed_is_an_http_error(gateway: Gateway, fake_cluster: Cluster, bad_worker: ScriptedWorker) -> None:
    response = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": fake_cluster.model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        headers=fake_cluster.headers(),
        timeout=10,
    )
    assert response.status_code in (500, 502), response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert body["request_id"] == response.headers["request-id"]
    assert bad_worker.url not in response.text and "Traceback" not in response.text
    row = audit_row(body["request_id"])
    assert row.status == "failed" and row.http_status == response.status_code


def test_generation_worker_dying_mid_stream_non_streamed_is_a_502(gateway: Gateway, cluster: Cluster) -> None:
    response = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": cluster.model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi [sim tokens=50 gen_fail_after=3]"}]},
        headers=cluster.headers(),
        timeout=10,
    )
    assert response.status_code == 502, response.text
    assert response.json()["error"]["type"] == "api_error"
    row = audit_row(response.headers["request-id"])
    assert row.status == "failed" and row.http_status == 502 and row.stage == "generation"


# --- the whole-request deadline ---------------------------------------------------------------------


@pytest.fixture
def deadline_gateway(gateways: Callable[..., Gateway]) -> Gateway:
    return gateways(MESSAGES_REQUEST_DEADLINE_S=str(DEADLINE_S))


@pytest.mark.parametrize("bad_worker", [([GOOD_START], "hang")], indirect=True)
def test_the_deadline_ends_a_stalled_stream(
    deadline_gateway: Gateway, context_worker: SimWorker, bad_worker: ScriptedWorker, transactional_db: Any
) -> None:
    cluster = register_fake(context_worker, bad_worker)
    wait_registered(deadline_gateway, cluster)
    s = send(deadline_gateway, cluster, "hi", stream=True)
    error = assert_ended_with_error(s, "timeout_error")
    assert DEADLINE_S - 0.1 <= s.frames[-1].at < DEADLINE_S + 2.0
    assert f"{DEADLINE_S:g} seconds" in error["error"]["message"]
    bad_worker.wait_for_hang_up()
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "failed" and row.error_type == "timeout_error" and row.http_status == 200
    assert {r.outcome for r in reservations_closed(row.request_id)} == {"cancelled"}


def test_the_deadline_before_the_stream_is_a_504(
    deadline_gateway: Gateway, transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    from tests.support.cluster import register_cluster

    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(deadline_gateway, cluster)
    started = time.monotonic()
    response = httpx.post(
        deadline_gateway.url + "/v1/messages",
        json={"model": cluster.model, "max_tokens": 8, "messages": [{"role": "user", "content": "slow [sim context_delay=30]"}]},
        headers=cluster.headers(),
        timeout=10,
    )
    assert time.monotonic() - started < DEADLINE_S + 2.0
    assert response.status_code == 504, response.text
    assert response.json()["error"]["type"] == "timeout_error"
    # The context worker saw its request abandoned, and every reservation was released.
    cluster.context.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    row = audit_row(response.headers["request-id"])
    assert row.status == "failed" and row.http_status == 504 and row.stage == "context"
    assert {r.outcome for r in reservations_closed(row.request_id)} == {"cancelled"}


def test_the_deadline_after_pings_is_an_error_event(
    deadline_gateway: Gateway, transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    from tests.support.cluster import register_cluster

    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(deadline_gateway, cluster)
    payload = {"model": cluster.model, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "slow [sim context_delay=30]"}]}
    s = RawStream.post_json(deadline_gateway.url + "/v1/messages", payload, cluster.headers())
    frames = s.read_all(timeout=10)
    events = [f.event for f in frames]
    assert events[0] == "ping" and events[-1] == "error" and "message_start" not in events, events
    assert frames[-1].data["error"]["type"] == "timeout_error"
    # No ping after the error: the heartbeat stopped with the stream.
    cluster.context.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "failed" and row.error_type == "timeout_error" and row.stage == "context"
    reservations_closed(row.request_id)
