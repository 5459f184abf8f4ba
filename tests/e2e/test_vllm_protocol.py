"""vLLM's prefill/decode protocol: the builders, the sim's vLLM dialect, and requests end to end
through daphne in front of a pair of vLLM-dialect sim workers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async

from tests.support.cluster import Cluster, audit_row, register_cluster, reservations_closed, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.ports import refused_url
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker
from workers import protocols
from workers.cluster.registry import get_registry
from workers.exceptions import MalformedAnswer
from workers.protocols import vllm
from workers.protocols.base import Call, ContextPeer
from workers.schedule.pipeline import ChatRun
from workers.sim.dialects.vllm import engine_id

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# The keys of a real vLLM 0.32 prefill answer's kv_transfer_params (NixlConnector).
NIXL_ANSWER_KEYS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
    "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens",
}
# vLLM's whole answer to a decode whose params name no KV it can pull (a real server's, byte for byte).
INTERNAL_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}

CALL = Call(request_id="req_vllm_unit")
CHAT: dict[str, Any] = {"model": "sim-model", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


# --- the builders ----------------------------------------------------------------------------------


def prefill(chat: dict[str, Any]) -> dict[str, Any]:
    return vllm.PROTOCOL.context_request(chat, CALL, pair_id=7, schedule_style="context_first", context=ContextPeer(url="http://p"))


def test_the_prefill_leg_is_what_vllm_router_sends() -> None:
    chat = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0}
    body = prefill(chat)
    assert body["max_tokens"] == 1 and body["min_tokens"] == 1
    assert body["stream"] is False and "stream_options" not in body
    assert "max_completion_tokens" not in body  # only clamped where the client sent it
    assert body["kv_transfer_params"] == PREFILL_PARAMS
    assert {k: v for k, v in body.items() if k not in ("max_tokens", "min_tokens", "stream", "kv_transfer_params")} == {
        k: v for k, v in chat.items() if k not in ("max_tokens", "min_tokens", "stream", "stream_options")
    }
    assert chat["max_tokens"] == 64 and chat["stream_options"] == {"include_usage": True}  # not mutated
    assert prefill({**CHAT, "max_completion_tokens": 64})["max_completion_tokens"] == 1
    assert prefill(CHAT)["min_tokens"] == 1
    # Each request gets its own params object (the pipeline may build several at once).
    assert prefill(CHAT)["kv_transfer_params"] is not prefill(CHAT)["kv_transfer_params"]


def test_the_decode_leg_carries_the_prefill_params_verbatim() -> None:
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [[1, 2]],
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "extra": {"nested": [1]},
    }
    answer = {"choices": [{"index": 0, "finish_reason": "length"}], "usage": {"prompt_tokens": 12}, "kv_transfer_params": params}
    handoff = vllm.PROTOCOL.read_context_answer(answer)
    assert handoff.generation_pending and handoff.complete_answer is None and handoff.prompt_tokens == 12
    body = vllm.PROTOCOL.generation_request_after_context({**CHAT, "stream": False}, CALL, handoff)
    assert body["kv_transfer_params"] == params
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["max_tokens"] == 64 and body["messages"] == CHAT["messages"]


def test_a_prefill_answer_without_params_is_a_502() -> None:
    for answer in (
        {"choices": [{"index": 0, "finish_reason": "length"}]},
        {"choices": [{"index": 0, "finish_reason": "length"}], "kv_transfer_params": None},
        {"choices": [{"index": 0, "finish_reason": "stop"}], "kv_transfer_params": "yes"},
        {"choices": [{"index": 0, "finish_reason": "length"}], "kv_transfer_params": {}},
        {"choices": [{"index": 0, "finish_reason": "length"}], "kv_transfer_params": [1]},
    ):
        with pytest.raises(MalformedAnswer) as failure:
            vllm.PROTOCOL.read_context_answer(answer)
        assert failure.value.status == 502 and failure.value.stage == "context"
        assert "kv_transfer_params" in failure.value.message


def test_a_prefill_that_stopped_is_decoded_without_params() -> None:
    """A stop string on the one prefill token: vLLM's connectors hold no KV then and answer
    `kv_transfer_params: null`; the routers decode without params (the decode prefills)."""
    answer = {"choices": [{"index": 0, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3}, "kv_transfer_params": None}
    handoff = vllm.PROTOCOL.read_context_answer(answer)
    assert not handoff.generation_pending and handoff.complete_answer is None
    body = vllm.PROTOCOL.generation_request_after_context(CHAT, CALL, handoff)
    assert "kv_transfer_params" not in body and body["stream"] is True


def test_headers_schedules_and_aggregated() -> None:
    assert vllm.PROTOCOL.headers({}, CALL) == {"X-Request-Id": "req_vllm_unit"}
    assert protocols.lookup("vllm") is vllm.PROTOCOL
    assert protocols.misconfiguration("vllm", "context_first") is None
    assert protocols.misconfiguration("vllm", "aggregated") is None
    assert "cannot run the 'generation_first' schedule" in (protocols.misconfiguration("vllm", "generation_first") or "")
    body = vllm.PROTOCOL.aggregated_request({**CHAT, "kv_transfer_params": {"do_remote_prefill": True}}, CALL)
    assert "kv_transfer_params" not in body and body["stream"] is True
    with pytest.raises(TypeError):
        vllm.PROTOCOL.generation_request_after_context(CHAT, CALL, object())  # type: ignore[arg-type]


# --- the sim's vLLM dialect, spoken to directly ----------------------------------------------------------


@pytest.fixture
def pair(sim_pair: Callable[..., tuple[SimWorker, SimWorker]]) -> tuple[SimWorker, SimWorker]:
    context, generation = sim_pair("vllm")
    context.reset()
    generation.reset()
    return context, generation


def chat_post(worker: SimWorker, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(worker.url + "/v1/chat/completions", json=body, headers=headers, timeout=10, trust_env=False)


def sim_prefill(context: SimWorker, text: str = "prefill me") -> dict[str, Any]:
    response = chat_post(
        context, {**CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def decode_body(params: dict[str, Any], text: str = "prefill me") -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "kv_transfer_params": params}


def test_sim_prefill_answers_as_nixl_does(pair: tuple[SimWorker, SimWorker]) -> None:
    context, generation = pair
    held = context.stats()["kv_held"]
    answer = sim_prefill(context)
    params = answer["kv_transfer_params"]
    assert set(params) == NIXL_ANSWER_KEYS
    assert (params["do_remote_prefill"], params["do_remote_decode"], params["transfer_mode"]) == (True, False, "pull")
    assert f"http://{params['remote_host']}:{params['remote_port']}" == context.url
    assert params["remote_engine_id"] == engine_id(context.url)
    assert params["remote_num_tokens"] == answer["usage"]["prompt_tokens"] > 0
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 1
    assert context.stats()["kv_held"] == held + 1
    assert chat_post(generation, decode_body(params)).status_code == 200
    assert context.stats()["kv_held"] == held


def test_sim_decode_takes_the_kv_once_and_answers_500_after(pair: tuple[SimWorker, SimWorker]) -> None:
    context, generation = pair
    params = sim_prefill(context)["kv_transfer_params"]
    taken = context.stats()["kv_taken"]
    first = chat_post(generation, decode_body(params))
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 4
    assert context.stats()["kv_taken"] == taken + 1
    again = chat_post(generation, decode_body(params))  # the same handoff, used
    assert (again.status_code, again.json()) == (500, INTERNAL_ERROR)


@pytest.mark.parametrize(
    "change",
    [
        {"remote_engine_id": "no-such-engine"},  # what the real server was sent (it answered this 500)
        {"remote_request_id": "chatcmpl-b4895fbd1666fade-aa1aec87"},
        {"remote_port": "5600"},
        {"remote_host": ""},
    ],
)
def test_sim_decode_with_params_naming_no_kv_is_vllms_bare_500(pair: tuple[SimWorker, SimWorker], change: dict[str, Any]) -> None:
    context, generation = pair
    params = sim_prefill(context)["kv_transfer_params"]
    response = chat_post(generation, decode_body({**params, **change}))
    assert (response.status_code, response.json()) == (500, INTERNAL_ERROR)
    assert generation.stats()["failed"] == 1
    # The KV was not touched: the params as issued still take it.
    assert chat_post(generation, decode_body(params)).status_code == 200


def test_sim_decode_without_pull_fields_prefills_locally(pair: tuple[SimWorker, SimWorker]) -> None:
    """NixlConnector warns "This request will not utilize KVTransfer" and computes the prompt."""
    context, generation = pair
    params = sim_prefill(context)["kv_transfer_params"]
    held, taken = context.stats()["kv_held"], context.stats()["kv_taken"]
    for incomplete in ({k: v for k, v in params.items() if k != "remote_request_id"}, {**params, "remote_block_ids": []}):
        response = chat_post(generation, decode_body(incomplete))
        assert response.status_code == 200, response.text
    assert (context.stats()["kv_held"], context.stats()["kv_taken"]) == (held, taken)
    assert chat_post(generation, decode_body(params)).status_code == 200


def test_sim_refuses_params_that_are_not_an_object_and_ignores_disaggregated_params(pair: tuple[SimWorker, SimWorker]) -> None:
    context, _ = pair
    response = chat_post(context, {**CHAT, "kv_transfer_params": "please"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body.kv_transfer_params"
    # TensorRT-LLM's field is an unknown one to vLLM: accepted and ignored, a plain request.
    held = context.stats()["kv_held"]
    plain = chat_post(context, {**CHAT, "max_tokens": 3, "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 5}})
    assert plain.status_code == 200, plain.text
    # A plain answer carries no handoff: real vLLM writes the field as null on every answer.
    assert plain.json().get("kv_transfer_params") is None and plain.json()["usage"]["completion_tokens"] == 3
    assert context.stats()["kv_held"] == held


def test_sim_request_log_records_the_request_id_header_only(pair: tuple[SimWorker, SimWorker]) -> None:
    context, _ = pair
    chat_post(context, {**CHAT, "max_tokens": 1}, **{"X-Request-Id": "req_log", "Authorization": "Bearer secret"})
    [entry] = httpx.get(context.url + "/sim/requests?headers=1", timeout=5).json()
    assert entry["headers"] == {"x-request-id": "req_log"} and entry["body"]["max_tokens"] == 1
    assert context.requests() == [entry["body"]]  # the plain log is unchanged


# --- end to end through the gateway ----------------------------------------------------------------


@pytest.fixture
def vllm_cluster(transactional_db: Any, gateway: Gateway, pair: tuple[SimWorker, SimWorker]) -> Cluster:
    cluster = register_cluster(*pair, protocol="vllm")
    wait_registered(gateway, cluster)
    return cluster


def logged(worker: SimWorker) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = httpx.get(worker.url + "/sim/requests?headers=1", timeout=5).json()
    return entries


def message(cluster: Cluster, text: str, *, stream: bool = False, max_tokens: int = 64) -> dict[str, Any]:
    return {"model": cluster.model, "max_tokens": max_tokens, "stream": stream, "messages": [{"role": "user", "content": text}]}


def post(gateway: Gateway, cluster: Cluster, text: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/messages", json=message(cluster, text), headers=cluster.headers(), timeout=30)


def duplicate_releases(gateway: Gateway) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_duplicate_releases_total":
                return float(sample.value)
    raise AssertionError("no gateway_duplicate_releases_total")


def assert_legs(cluster: Cluster, request_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request's one prefill and one decode leg, in their protocol's shape."""
    [prefill_leg] = logged(cluster.context)
    [decode_leg] = logged(cluster.generation)
    assert prefill_leg["headers"] == decode_leg["headers"] == {"x-request-id": request_id}
    body = prefill_leg["body"]
    assert (body["max_tokens"], body["min_tokens"], body["stream"]) == (1, 1, False)
    assert "stream_options" not in body and body["kv_transfer_params"] == PREFILL_PARAMS
    decode = decode_leg["body"]
    assert decode["stream"] is True and decode["stream_options"]["include_usage"] is True
    params = decode["kv_transfer_params"]
    assert set(params) == NIXL_ANSWER_KEYS and params["remote_engine_id"] == engine_id(cluster.context.url)
    assert decode["messages"] == body["messages"]
    return body, decode


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_through_a_vllm_pair(gateway: Gateway, vllm_cluster: Cluster, stream: bool) -> None:
    cluster = vllm_cluster
    payload = message(cluster, "Hello vLLM [sim tokens=5]", stream=stream)
    if stream:
        s = RawStream.post_json(gateway.url + "/v1/messages", payload, cluster.headers())
        frames = s.read_all()
        assert s.status == 200 and frames[-1].event == "message_stop", [f.event for f in frames]
        assert "error" not in s.events()
        start = next(f for f in frames if f.event == "message_start")
        assert start.data["message"]["usage"]["input_tokens"] > 0
        text = "".join(f.data["delta"].get("text", "") for f in frames if f.event == "content_block_delta")
        request_id = s.response_headers["request-id"]
    else:
        response = httpx.post(gateway.url + "/v1/messages", json=payload, headers=cluster.headers(), timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["output_tokens"] == 5
        text = response.json()["content"][0]["text"]
        request_id = response.headers["request-id"]
    assert text
    _, decode = assert_legs(cluster, request_id)
    assert decode["max_tokens"] == 64
    row = audit_row(request_id)
    assert row.status == "completed" and row.stage == "done" and row.output_tokens == 5
    assert {(r.stage, r.outcome) for r in reservations_closed(request_id)} == {("context", "success"), ("generation", "success")}
    stats = cluster.context.stats()
    assert stats["kv_taken"] == 1 and cluster.generation.stats()["completed"] == 1


async def test_the_decode_leg_relays_the_prefill_answers_params_verbatim(vllm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, so the prefill worker's answer itself can be seen (the real reader is called)."""
    cluster = vllm_cluster
    pool = (await get_registry().refresh()).pool_for_model(cluster.model)
    assert pool is not None and pool.protocol == "vllm"
    answers: list[dict[str, Any]] = []
    read = vllm.read_prefill_answer

    def seen(answer: dict[str, Any]) -> vllm.PrefillResult:
        answers.append(answer)
        return read(answer)

    monkeypatch.setattr(vllm, "read_prefill_answer", seen)
    chat = {"model": cluster.model, "max_tokens": 8, "messages": [{"role": "user", "content": "verbatim [sim tokens=3]"}]}
    async with ChatRun(chat, pool=pool, request_id="req_vllm_verbatim") as run:
        await run.stream_ready()
        chunks: list[dict[str, Any]] = []
        await run.relay(chunks.append)
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    [answer] = answers
    _, decode = await asyncio.to_thread(assert_legs, cluster, "req_vllm_verbatim")
    assert decode["kv_transfer_params"] == answer["kv_transfer_params"]
    rows = await sync_to_async(reservations_closed)("req_vllm_verbatim")
    assert sorted((r.stage, r.outcome) for r in rows) == [("context", "success"), ("generation", "success")]


def test_the_aggregated_schedule_sends_one_plain_leg(transactional_db: Any, gateway: Gateway, pair: tuple[SimWorker, SimWorker]) -> None:
    cluster = register_cluster(*pair, protocol="vllm", schedule_style="aggregated")
    wait_registered(gateway, cluster)
    response = post(gateway, cluster, "just decode [sim tokens=2]")
    assert response.status_code == 200, response.text
    [leg] = logged(cluster.generation)
    assert leg["headers"] == {"x-request-id": response.headers["request-id"]}
    assert "kv_transfer_params" not in leg["body"] and leg["body"]["stream"] is True
    assert logged(cluster.context) == []


def test_a_prefill_worker_without_a_kv_connector_is_a_clean_502(
    transactional_db: Any, gateway: Gateway, context_worker: SimWorker, pair: tuple[SimWorker, SimWorker]
) -> None:
    """A prefill worker that does not speak kv_transfer_params (here a TensorRT-LLM-dialect sim,
    for which the field is unknown) answers the max_tokens=1 request as a plain completion."""
    cluster = register_cluster(context_worker, pair[1], protocol="vllm")
    wait_registered(gateway, cluster)
    before = duplicate_releases(gateway)
    response = post(gateway, cluster, "no connector [sim tokens=2]")
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert context_worker.url not in response.text and "127.0.0.1" not in response.text
    request_id = response.headers["request-id"]
    row = audit_row(request_id)
    assert row.status == "failed" and row.http_status == 502 and row.stage == "context"
    assert "kv_transfer_params" in row.error_message
    rows = reservations_closed(request_id)
    assert sorted((r.stage, r.outcome) for r in rows) == [("context", "failure"), ("generation", "failure")]
    assert len({r.reservation_id for r in rows}) == len(rows) == 2
    assert duplicate_releases(gateway) == before
    assert context_worker.stats()["completed"] == 1
    assert cluster.generation.stats()["received"] == 0  # no decode without a handoff


def test_a_failed_decode_is_not_sent_again(gateway: Gateway, vllm_cluster: Cluster) -> None:
    """Its handoff is used up: the pipeline retries only a context connection failure."""
    cluster = vllm_cluster
    response = post(gateway, cluster, "fail the decode [sim gen_status=503]")
    assert response.status_code == 503, response.text
    assert cluster.generation.wait_for(lambda s: s["failed"] == 1)["received"] == 1
    assert cluster.context.stats()["received"] == 1 and cluster.context.stats()["kv_taken"] == 1
    rows = reservations_closed(response.headers["request-id"])
    assert sorted((r.stage, r.outcome) for r in rows) == [("context", "success"), ("generation", "failure")]


def test_a_context_connection_failure_is_retried_before_any_decode(gateway: Gateway, vllm_cluster: Cluster) -> None:
    from workers.models import WorkerEndpoint

    cluster = vllm_cluster
    dead = refused_url()
    WorkerEndpoint.objects.create(pool=cluster.pool, role="context", url=dead)
    wait_registered(gateway, cluster)
    retried = 0
    for attempt in range(1, 5):  # round robin reaches the dead endpoint within two requests
        response = post(gateway, cluster, "retry me [sim tokens=2]")
        assert response.status_code == 200, response.text
        rows = reservations_closed(response.headers["request-id"])
        retried += any(r.endpoint_url == dead and r.outcome == "failure" for r in rows)
        # One prefill and one decode reached the live pair per request, the retry included.
        assert (cluster.context.stats()["completed"], cluster.generation.stats()["completed"]) == (attempt, attempt)
    assert retried >= 1


# --- the client leaves --------------------------------------------------------------------------------------


def request_id_since(moment: datetime) -> str:
    from messages_api.models import MessageRequest

    return str(wait_until(lambda: MessageRequest.objects.filter(received_at__gte=moment).values_list("request_id", flat=True).first()))


def assert_released(request_id: str, stage: str) -> list[Any]:
    row = audit_row(request_id)
    assert row.status == "cancelled" and row.stage == stage, (row.status, row.stage)
    rows = reservations_closed(request_id)
    assert len({r.reservation_id for r in rows}) == len(rows)
    return rows


@pytest.mark.parametrize("stream", [False, True])
def test_leaving_during_prefill_releases_everything(gateway: Gateway, vllm_cluster: Cluster, stream: bool) -> None:
    cluster = vllm_cluster
    before = duplicate_releases(gateway)
    started = datetime.now(timezone.utc)
    s = RawStream.post_json(gateway.url + "/v1/messages", message(cluster, "slow prefill [sim context_delay=30]", stream=stream), cluster.headers())
    cluster.context.wait_for(lambda st: st["active"] == 1)
    request_id = request_id_since(started)
    s.close()
    cluster.context.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    rows = assert_released(request_id, "context")
    assert {r.outcome for r in rows} == {"cancelled"}
    assert cluster.generation.stats()["received"] == 0  # no KV was issued, so no decode was sent
    assert duplicate_releases(gateway) == before


@pytest.mark.parametrize("stream", [False, True])
def test_leaving_during_decode_releases_everything(gateway: Gateway, vllm_cluster: Cluster, stream: bool) -> None:
    cluster = vllm_cluster
    before = duplicate_releases(gateway)
    started = datetime.now(timezone.utc)
    s = RawStream.post_json(
        gateway.url + "/v1/messages", message(cluster, "long decode [sim tokens=20000]", stream=stream, max_tokens=30000), cluster.headers()
    )
    cluster.generation.wait_for(lambda st: st["active"] == 1)
    request_id = request_id_since(started)
    s.close()
    cluster.generation.wait_for(lambda st: st["aborted"] == 1 and st["active"] == 0)
    rows = assert_released(request_id, "generation")
    assert {r.stage: r.outcome for r in rows} == {"context": "success", "generation": "cancelled"}
    assert cluster.context.stats()["kv_taken"] == 1 and cluster.context.stats()["kv_held"] == 0
    assert duplicate_releases(gateway) == before


def test_a_misconfigured_generation_first_vllm_pool_reaches_no_worker(
    transactional_db: Any, gateway: Gateway, pair: tuple[SimWorker, SimWorker]
) -> None:
    cluster = register_cluster(*pair, protocol="vllm", schedule_style="generation_first")
    wait_registered(gateway, cluster)
    response = post(gateway, cluster, "never sent")
    assert response.status_code == 500, response.text
    assert cluster.context.stats()["received"] == 0 and cluster.generation.stats()["received"] == 0

