"""Every seed behaviour, for every registered protocol and every schedule it supports, through a
real daphne gateway and real sim workers speaking that protocol's dialect.

The matrix is built at collection time from the protocol registry (`workers.protocols.PROTOCOLS`
and each protocol's `schedules`), so a protocol registered there is covered here without a line
changed. A protocol whose pool needs more than the plain registration (a signing key, endpoint
options, sims started with options) gets an entry in `CLUSTER_SETUP`.

What each (protocol, schedule) must do:
- a streamed response starts (status line and a first frame) within 1 s even when the context
  phase (aggregated: the wait for the first token) takes 3 s, and pings keep it alive meanwhile;
- a failure before the stream starts (an HTTP error) and the same failure after it started (an
  `error` event) carry the same type and message; a failure after `message_start` is the error
  event of the same failure answered to a non-streamed request;
- a client leaving while the context phase runs (aggregated: before the first token) or while
  tokens stream releases every reservation exactly once and leaves exactly one terminal audit
  row, and the sim doing the work sees the abort;
- a success releases every reservation exactly once, as a success.

The gateways run with MESSAGES_STREAM_START_WAIT_S=0.3 and MESSAGES_PING_INTERVAL_S=0.5
(tests/support/gateway.py).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, audit_row, register_cluster, reservations_closed, wait_registered
from tests.support.gateway import PING_INTERVAL, Gateway
from tests.support.rawclient import Frame, RawStream
from tests.support.simworkers import SimWorker
from workers.protocols import AGGREGATED, PROTOCOLS

pytestmark = pytest.mark.django_db(transaction=True)

SLOW_PHASE_S = 3.0

SimPair = Callable[..., tuple[SimWorker, SimWorker]]
# (sim_pair, protocol, schedule_style) -> the registered cluster
ClusterSetup = Callable[[SimPair, str, str], Cluster]


def plain_cluster(sim_pair: SimPair, protocol: str, schedule_style: str) -> Cluster:
    """A context and a generation sim in the protocol's dialect, registered as one pool."""
    context, generation = sim_pair(protocol)
    return register_cluster(context, generation, protocol=protocol, schedule_style=schedule_style)


def sglang_cluster(sim_pair: SimPair, protocol: str, schedule_style: str) -> Cluster:
    """SGLang pairs the legs through the prefill server's bootstrap port (an endpoint option; a
    sim's is its HTTP port). An aggregated SGLang pool is servers run without disaggregation: a
    decode-mode server refuses a request without a bootstrap room, so a plain server serves it."""
    context, generation = sim_pair(protocol)
    if schedule_style == AGGREGATED:
        generation = sim_pair("openai")[1]
    return register_cluster(
        context, generation, protocol=protocol, schedule_style=schedule_style,
        context_options={"bootstrap_port": context.port},
    )


# protocol -> how to register its cluster, for a protocol whose pool needs more than
# `plain_cluster` (endpoint options, sims started with options). TensorRT-LLM's signing key is
# `register_cluster`'s default, shared with every sim.
CLUSTER_SETUP: dict[str, ClusterSetup] = {"sglang": sglang_cluster}

MATRIX = [(name, schedule) for name, protocol in sorted(PROTOCOLS.items()) for schedule in sorted(protocol.schedules)]


@pytest.fixture(params=MATRIX, ids=[f"{name}-{schedule}" for name, schedule in MATRIX])
def every(request: pytest.FixtureRequest, transactional_db: Any, gateway: Gateway, sim_pair: SimPair) -> Cluster:
    protocol, schedule_style = request.param
    cluster = CLUSTER_SETUP.get(protocol, plain_cluster)(sim_pair, protocol, schedule_style)
    cluster.context.reset()
    cluster.generation.reset()
    wait_registered(gateway, cluster)
    return cluster


def aggregated(cluster: Cluster) -> bool:
    return str(cluster.pool.schedule_style) == AGGREGATED


def slow_start(cluster: Cluster, seconds: float) -> str:
    """The directive that keeps the request from its first token for `seconds`: the context
    phase, or (aggregated: there is none) the generation worker's first token."""
    return f"gen_delay={seconds:g}" if aggregated(cluster) else f"context_delay={seconds:g}"


def fail_slowly(cluster: Cluster, status: int, seconds: float = 0.0) -> str:
    """The directive that fails the request with `status` after `seconds`, in the first phase."""
    if aggregated(cluster):
        return f"gen_status={status}" + (f" gen_delay={seconds:g}" if seconds else "")
    return f"context_status={status}" + (f" context_delay={seconds:g}" if seconds else "")


def waiting_worker(cluster: Cluster) -> SimWorker:
    """The sim that works while the request waits for its first token."""
    return cluster.generation if aggregated(cluster) else cluster.context


def expected_stages(cluster: Cluster) -> set[str]:
    return {"generation"} if aggregated(cluster) else {"context", "generation"}


def payload(cluster: Cluster, text: str, *, stream: bool) -> dict[str, Any]:
    return {"model": cluster.model, "max_tokens": 256, "stream": stream, "messages": [{"role": "user", "content": text}]}


def stream(gateway: Gateway, cluster: Cluster, text: str) -> RawStream:
    return RawStream.post_json(gateway.url + "/v1/messages", payload(cluster, text, stream=True), cluster.headers())


def post(gateway: Gateway, cluster: Cluster, text: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/messages", json=payload(cluster, text, stream=False), headers=cluster.headers(), timeout=30)


def non_ping(frames: list[Frame]) -> list[str]:
    return [f.event for f in frames if f.event != "ping"]


def assert_one_terminal_row(request_id: str, status: str) -> Any:
    from messages_api.models import MessageRequest

    row = audit_row(request_id)
    assert row.status == status, (row.status, row.stage, row.error_message)
    assert MessageRequest.objects.filter(request_id=request_id).count() == 1
    return row


def assert_released_once(cluster: Cluster, request_id: str) -> dict[str, str]:
    """Every reservation of the request released, each exactly once: one row per stage the
    schedule reserves, each closed. Returns stage -> outcome."""
    rows = reservations_closed(request_id)
    assert len({r.reservation_id for r in rows}) == len(rows)
    assert sorted(r.stage for r in rows) == sorted(expected_stages(cluster)), [(r.stage, r.outcome) for r in rows]
    return {r.stage: r.outcome for r in rows}


# --- success ---------------------------------------------------------------------------------------


def test_success_releases_every_reservation_once(gateway: Gateway, every: Cluster) -> None:
    s = stream(gateway, every, "hello [sim tokens=3]")
    frames = s.read_all()
    events = non_ping(frames)
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"], events
    request_id = s.response_headers["request-id"]
    assert_one_terminal_row(request_id, "completed")
    assert set(assert_released_once(every, request_id).values()) == {"success"}
    every.generation.wait_for(lambda st: st["completed"] == 1 and st["active"] == 0)


# --- a slow start ----------------------------------------------------------------------------------


def test_a_slow_first_phase_starts_the_stream_at_once_and_pings(gateway: Gateway, every: Cluster) -> None:
    s = stream(gateway, every, f"slow [sim {slow_start(every, SLOW_PHASE_S)} tokens=3]")
    assert s.read_head() == 200
    assert s.response_headers["content-type"].startswith("text/event-stream")
    first = s.read_until("ping")
    # The status line and a first frame, well before the slow phase ends.
    assert s.head_at is not None and s.head_at < 1.0 and first.at < 1.0, (s.head_at, first.at)
    frames = s.read_all()
    events = [f.event for f in frames]
    start = events.index("message_start")
    assert set(events[:start]) == {"ping"}
    assert frames[start].at >= SLOW_PHASE_S - 0.2
    # Pings all through the wait: no silence longer than the interval (plus scheduling slack).
    times = [f.at for f in frames[: start + 1]]
    assert len(times) >= SLOW_PHASE_S / PING_INTERVAL - 1
    assert max(b - a for a, b in pairwise(times)) < PING_INTERVAL + 0.3
    assert non_ping(frames)[-2:] == ["message_delta", "message_stop"]
    row = assert_one_terminal_row(s.response_headers["request-id"], "completed")
    assert row.pings_sent >= 3


# --- failures --------------------------------------------------------------------------------------


def test_a_failure_carries_the_same_message_before_and_after_the_stream_starts(
    gateway: Gateway, patient_gateway: Gateway, every: Cluster
) -> None:
    wait_registered(patient_gateway, every)
    fast = stream(patient_gateway, every, f"fail [sim {fail_slowly(every, 503)}]")
    fast_body = fast.body_json()
    assert fast.status == 503 and fast.response_headers["content-type"] == "application/json"
    assert_one_terminal_row(fast_body["request_id"], "failed")

    late = stream(gateway, every, f"fail [sim {fail_slowly(every, 503, 1)}]")
    assert late.read_head() == 200
    frames = late.read_all()
    events = [f.event for f in frames]
    assert events[-1] == "error" and "message_stop" not in events, events
    assert frames[-1].data["error"] == fast_body["error"]
    request_id = late.response_headers["request-id"]
    row = assert_one_terminal_row(request_id, "failed")
    assert row.error_message == fast_body["error"]["message"]
    assert "failure" in assert_released_once(every, request_id).values()


def test_a_failure_after_message_start_is_the_non_streamed_error(gateway: Gateway, every: Cluster) -> None:
    directive = "[sim tokens=50 gen_fail_after=3]"
    answered = post(gateway, every, f"break {directive}")
    assert answered.status_code >= 500, answered.text
    s = stream(gateway, every, f"break {directive}")
    frames = s.read_all()
    events = non_ping(frames)
    assert events[0] == "message_start" and events[-1] == "error", events
    assert "message_delta" not in events and "message_stop" not in events
    assert frames[-1].data["error"] == answered.json()["error"]
    request_id = s.response_headers["request-id"]
    assert_one_terminal_row(request_id, "failed")
    assert assert_released_once(every, request_id)["generation"] == "failure"


# --- the client goes away --------------------------------------------------------------------------


def test_leaving_during_the_first_phase(gateway: Gateway, every: Cluster) -> None:
    worker = waiting_worker(every)
    s = stream(gateway, every, f"leave [sim {slow_start(every, 30)}]")
    assert s.read_head() == 200
    s.read_until("ping")
    worker.wait_for(lambda st: st["active"] == 1)
    s.close()
    # The sim doing the work sees the abort, and nothing is left running anywhere (generation
    # first: the generation sim's wait for the KV may end as the context sim's abort reaches it,
    # a failure, or as the gateway's hang-up, an abort; neither answers).
    worker.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    for sim in (every.context, every.generation):
        sim.wait_for(lambda st: st["active"] == 0 and st["completed"] == 0)
    request_id = s.response_headers["request-id"]
    row = assert_one_terminal_row(request_id, "cancelled")
    assert row.stage == ("generation" if aggregated(every) else "context")
    assert set(assert_released_once(every, request_id).values()) == {"cancelled"}


def test_leaving_while_tokens_stream(gateway: Gateway, every: Cluster) -> None:
    s = stream(gateway, every, "long answer [sim tokens=20000]")
    s.read_until("content_block_delta")
    s.close()
    every.generation.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    request_id = s.response_headers["request-id"]
    row = assert_one_terminal_row(request_id, "cancelled")
    assert row.stage == "generation"
    outcomes = assert_released_once(every, request_id)
    assert outcomes["generation"] == "cancelled"
    if not aggregated(every):
        assert outcomes["context"] == "success"
        every.context.wait_for(lambda st: st["completed"] == 1 and st["aborted"] == 0 and st["active"] == 0)
