"""Issue 9's malformed worker chunks through the whole gateway: each ends a streamed answer with an
`error` event naming the field (never `message_stop`, never a silent open stream) and a
non-streamed one with a 502 — against a real daphne and a scripted generation worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, audit_row, wait_registered
from tests.fakeworker import ScriptedWorker, chunk
from tests.gateway import Gateway
from tests.simworkers import SimWorker
from tests.test_error_boundary import assert_ended_with_error, register_fake, send

pytestmark = pytest.mark.django_db(transaction=True)

GOOD_START = chunk({"role": "assistant", "content": "Hello"})

# (frame after a good chunk, the field the error must name)
CASES = {
    "choices-null": (b'{"choices":[null]}', "choices[0] is not an object"),
    "list": (b"[1,2,3]", "the chunk is not an object"),
    "choices-string": (b'{"choices":"abc"}', "choices is not a list"),
    "number": (b"5", "the chunk is not an object"),
    "usage-number": (b'{"choices":[],"usage":5}', "usage is not an object"),
    "usage-count-string": (b'{"choices":[],"usage":{"prompt_tokens":"many"}}', "usage.prompt_tokens is not a non-negative integer"),
    "arguments-object": (
        b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":{"a":1}}}]}}]}',
        "choices[0].delta.tool_calls[0].function.arguments is not a string",
    ),
    "delta-null": (b'{"choices":[{"delta":null}]}', "choices[0].delta is missing or null"),
    "content-number": (b'{"choices":[{"index":0,"delta":{"content":5}}]}', "choices[0].delta.content is not a string"),
    "content-object": (b'{"choices":[{"index":0,"delta":{"content":{"a":1}}}]}', "choices[0].delta.content is not a string"),
}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[bytes, str]:
    return CASES[request.param]


@pytest.fixture
def bad_worker(case: tuple[bytes, str]) -> Iterator[ScriptedWorker]:
    frame, _ = case
    # Then [DONE]: the gateway must stop at the bad chunk, not carry on to a clean end.
    with ScriptedWorker([GOOD_START, b"data: " + frame + b"\n\n", b"data: [DONE]\n\n"], then="hang") as worker:
        yield worker


@pytest.fixture
def fake_cluster(transactional_db: Any, gateway: Gateway, context_worker: SimWorker, bad_worker: ScriptedWorker) -> Cluster:
    cluster = register_fake(context_worker, bad_worker)
    wait_registered(gateway, cluster)
    return cluster


def test_a_malformed_chunk_ends_a_stream_with_an_error_event_and_a_whole_answer_with_a_502(
    gateway: Gateway, fake_cluster: Cluster, bad_worker: ScriptedWorker, case: tuple[bytes, str]
) -> None:
    """Both in one test: one registered cluster per case keeps the matrix quick."""
    message = f"the generation worker sent a malformed stream chunk: {case[1]}"
    s = send(gateway, fake_cluster, "hi", stream=True)
    assert s.read_head() == 200
    assert assert_ended_with_error(s, "api_error")["error"]["message"] == message
    bad_worker.wait_for_hang_up()

    response = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": fake_cluster.model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        headers=fake_cluster.headers(),
        timeout=10,
    )
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["error"] == {"type": "api_error", "message": message}
    row = audit_row(body["request_id"])
    assert row.status == "failed" and row.http_status == 502
