"""Plain OpenAI-compatible pools: no context phase, generation endpoints only, end to end through
daphne and a sim speaking no disaggregation at all."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.core.management import call_command

from tests.support.cluster import SIM_OPTIONS, audit_row, reservations_closed, wait_until
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker, start_simworker
from workers.protocols import lookup
from workers.protocols.base import AGGREGATED, Call, ContextPeer
from workers.protocols.openai import PROTOCOL
from workers.sim.config import SimConfig
from workers.sim.dialects import get as dialect

CHAT: dict[str, Any] = {"model": "plain-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}
MODEL = "plain-model"


def test_registered_for_the_aggregated_schedule_only() -> None:
    assert lookup("openai") is PROTOCOL
    assert PROTOCOL.schedules == {AGGREGATED}


def test_the_request_is_streamed_with_final_usage_only() -> None:
    body = PROTOCOL.aggregated_request(dict(CHAT), Call(request_id="r"))
    assert body["stream"] is True
    # continuous_usage_stats is vLLM's (and SGLang's): not sent to a server of unknown make.
    assert body["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in body.items() if k not in ("stream", "stream_options")} == CHAT


def test_it_has_no_context_phase() -> None:
    with pytest.raises(NotImplementedError):
        PROTOCOL.context_request(dict(CHAT), Call(request_id="r"), pair_id=1, schedule_style=AGGREGATED, context=ContextPeer(url="http://x"))


def test_the_plain_sim_ignores_any_engine_disaggregation_fields() -> None:
    fields = {
        "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 1},
        "kv_transfer_params": {"do_remote_prefill": True},
        "bootstrap_room": "not even an integer",
    }
    for role in ("context", "generation"):
        assert dialect("openai").parse({**CHAT, **fields}, {}, SimConfig(role=role, protocol="openai")) is None  # type: ignore[arg-type]
    assert dialect("openai").server_info(SimConfig(role="generation", protocol="openai"), "http://x") is None


# --- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_worker() -> Iterator[SimWorker]:
    worker = start_simworker("generation", **{**SIM_OPTIONS, "protocol": "openai"})
    yield worker
    worker.stop()


@pytest.fixture
def plain_pool(transactional_db: Any, gateway: Gateway, plain_worker: SimWorker) -> Any:
    """Registered the way an operator does it: `register_worker`, a generation endpoint only."""
    from messages_api.auth import create_api_key
    from workers.models import WorkerPool

    call_command(
        "register_worker", pool="plain", model=MODEL, role="generation", url=plain_worker.url,
        protocol="openai", schedule_style=AGGREGATED, stdout=open("/dev/null", "w"),
    )
    pool = WorkerPool.objects.get(name="plain")
    _, key = create_api_key(f"plain-{time.monotonic_ns()}")
    plain_worker.reset()
    # Routable, not only listed: a request in between is answered 529 (seen in CI, 2026-12-03).
    wait_until(
        lambda: (seen := ready(gateway)[1].get("plain", {})).get("id") == pool.id and seen["generation"]["routable"] == 1,
        message="gateway never routed to the plain pool",
    )
    return {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}


def ready(gateway: Gateway) -> tuple[int, dict[str, Any]]:
    response = httpx.get(gateway.url + "/ready", timeout=5)
    return response.status_code, response.json()["pools"]


def payload(text: str, *, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": text}]}


def test_a_pool_with_generation_endpoints_only_is_ready(gateway: Gateway, plain_pool: dict[str, str]) -> None:
    status, pools = ready(gateway)
    assert status == 200
    assert pools["plain"]["context"] == {"registered": 0, "routable": 0}
    assert pools["plain"]["generation"] == {"registered": 1, "routable": 1}


def assert_served(worker: SimWorker, request_id: str) -> None:
    [body] = worker.requests()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    worker.wait_for(lambda s: s["completed"] == 1 and s["active"] == 0)
    row = audit_row(request_id)
    assert (row.status, row.stage, row.output_tokens) == ("completed", "done", 5)
    assert (row.context_endpoint, row.generation_endpoint) == ("", worker.url)
    assert [(r.stage, r.outcome) for r in reservations_closed(request_id)] == [("generation", "success")]


def test_non_streamed_answer(gateway: Gateway, plain_pool: dict[str, str], plain_worker: SimWorker) -> None:
    response = httpx.post(gateway.url + "/v1/messages", json=payload("hi [sim tokens=5]", stream=False), headers=plain_pool, timeout=30)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["output_tokens"] == 5 and usage["input_tokens"] > 0  # from the final usage chunk
    assert_served(plain_worker, response.headers["request-id"])


def test_streamed_answer(gateway: Gateway, plain_pool: dict[str, str], plain_worker: SimWorker) -> None:
    stream = RawStream.post_json(gateway.url + "/v1/messages", payload("hi [sim tokens=5]", stream=True), plain_pool)
    frames = stream.read_all()
    assert stream.status == 200
    events = [f.event for f in frames if f.event != "ping"]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    [delta] = [f.data for f in frames if f.event == "message_delta"]
    [start] = [f.data for f in frames if f.event == "message_start"]
    # Usage arrives on the last chunk only: message_start carries the gateway's estimate of the
    # prompt (never 0), the final message_delta the worker's count.
    assert start["message"]["usage"]["input_tokens"] > 0
    assert delta["usage"]["output_tokens"] == 5 and delta["usage"]["input_tokens"] > 0
    assert "".join(f.data["delta"].get("text", "") for f in frames if f.event == "content_block_delta")
    assert_served(plain_worker, stream.response_headers["request-id"])
