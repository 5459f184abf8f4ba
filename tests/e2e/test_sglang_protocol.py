"""SGLang's bootstrap-room protocol: the builders, the sim dialect, and requests end to end
through daphne and a prefill + decode pair of sims speaking SGLang's dialect."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster import MODEL, Cluster, audit_row, register_cluster, reservations_closed, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.ports import unused_port
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker
from workers.exceptions import WorkerError
from workers.protocols import lookup
from workers.protocols.base import AGGREGATED, GENERATION_FIRST, Call, ContextPeer
from workers.protocols.sglang import PROTOCOL
from workers.sim.config import SimConfig
from workers.sim.dialects import get as dialect
from workers.sim.dialects.sglang import NO_ROOM
from workers.sim.error_answers import SimError
from workers.sim.process import stop_process

CHAT: dict[str, Any] = {"model": "sim-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}
CALL = Call(request_id="req_unit")
PREFILL = ContextPeer(url="http://10.1.2.3:30000", options={"bootstrap_port": 8998})


# --- the gateway's builders ---------------------------------------------------------------------


def test_registered_with_its_schedules() -> None:
    assert lookup("sglang") is PROTOCOL
    assert PROTOCOL.schedules == {GENERATION_FIRST, AGGREGATED}


def test_both_legs_carry_the_same_bootstrap_fields() -> None:
    room = 2**63 - 1
    decode = PROTOCOL.generation_request_first(dict(CHAT), CALL, pair_id=room, context=PREFILL, schedule_style=GENERATION_FIRST)
    prefill = PROTOCOL.context_request(dict(CHAT), CALL, pair_id=room, schedule_style=GENERATION_FIRST, context=PREFILL)
    trio = {"bootstrap_host": "10.1.2.3", "bootstrap_port": 8998, "bootstrap_room": room}
    assert {k: decode[k] for k in trio} == trio == {k: prefill[k] for k in trio}
    # The decode leg streams with usage on every chunk; the prefill leg is read as one object.
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert prefill["stream"] is False and "stream_options" not in prefill
    # Otherwise both are the client's request, unchanged.
    strip = ("stream", "stream_options", *trio)
    assert {k: v for k, v in decode.items() if k not in strip} == CHAT == {k: v for k, v in prefill.items() if k not in strip}


def test_bootstrap_port_is_null_without_one_and_refused_when_not_a_port() -> None:
    bare = ContextPeer(url="http://[fd00::7]:30000")
    body = PROTOCOL.generation_request_first(dict(CHAT), CALL, pair_id=5, context=bare, schedule_style=GENERATION_FIRST)
    assert (body["bootstrap_host"], body["bootstrap_port"]) == ("fd00::7", None)
    for port in ("8998", 0, 70000, True):
        peer = ContextPeer(url=PREFILL.url, options={"bootstrap_port": port})
        with pytest.raises(WorkerError) as refused:
            PROTOCOL.context_request(dict(CHAT), CALL, pair_id=5, schedule_style=GENERATION_FIRST, context=peer)
        assert refused.value.code == "misconfigured" and "10.1.2.3" not in refused.value.message


def test_a_room_outside_63_bits_is_never_sent() -> None:
    with pytest.raises(ValueError):
        PROTOCOL.context_request(dict(CHAT), CALL, pair_id=2**63, schedule_style=GENERATION_FIRST, context=PREFILL)


def test_aggregated_carries_no_bootstrap_fields() -> None:
    body = PROTOCOL.aggregated_request({**CHAT, "bootstrap_room": 3}, CALL)
    assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & body.keys()
    assert body["stream"] is True


def test_the_prefill_answer_is_dropped_but_its_prompt_count_kept() -> None:
    handoff = PROTOCOL.read_context_answer({"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 12}})
    assert (handoff.generation_pending, handoff.complete_answer, handoff.prompt_tokens) == (True, None, 12)
    for usage in (None, {"prompt_tokens": "12"}, {"prompt_tokens": -1}, {"prompt_tokens": True}, []):
        assert PROTOCOL.read_context_answer({"usage": usage}).prompt_tokens is None


# --- the sim dialect ------------------------------------------------------------------------------

PREFILL_SIM = SimConfig(role="context", port=8100, protocol="sglang")
DECODE_SIM = SimConfig(role="generation", port=8200, protocol="sglang")
BOOTSTRAP = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8100, "bootstrap_room": 42}


def refusal(body: dict[str, Any], config: SimConfig) -> SimError:
    with pytest.raises(SimError) as refused:
        dialect("sglang").parse(body, {}, config)
    assert refused.value.status == 400
    return refused.value


@pytest.mark.parametrize("config", [PREFILL_SIM, DECODE_SIM])
def test_sim_refuses_what_a_disaggregated_sglang_server_refuses(config: SimConfig) -> None:
    assert refusal(dict(CHAT), config).message == NO_ROOM
    for room in ("42", 4.2, True, -1, 2**63, [42]):
        assert refusal({**CHAT, **BOOTSTRAP, "bootstrap_room": room}, config).param == "bootstrap_room"
    assert refusal({**CHAT, **BOOTSTRAP, "bootstrap_port": "8100"}, config).param == "bootstrap_port"


def test_sim_decode_needs_the_prefill_address() -> None:
    assert refusal({**CHAT, **BOOTSTRAP, "bootstrap_host": None}, DECODE_SIM).param == "bootstrap_host"
    assert refusal({**CHAT, **BOOTSTRAP, "bootstrap_port": None}, DECODE_SIM).param == "bootstrap_port"


def test_sim_reads_the_room_into_the_neutral_form() -> None:
    prefill = dialect("sglang").parse({**CHAT, **BOOTSTRAP, "bootstrap_port": None}, {}, PREFILL_SIM)
    assert prefill is not None and (prefill.request_type, prefill.handoff_id) == ("context_only", 42)
    decode = dialect("sglang").parse({**CHAT, **BOOTSTRAP, "bootstrap_host": "::1"}, {}, DECODE_SIM)
    assert decode is not None and (decode.request_type, decode.handoff_id, decode.rendezvous) == ("generation_only", 42, True)
    assert decode.kv_source_url == "http://[::1]:8100"


def test_sim_server_info_names_the_bootstrap_port_and_no_model_path() -> None:
    info = dialect("sglang").server_info(PREFILL_SIM, "http://127.0.0.1:8100")
    assert info is not None
    assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == ("prefill", 8100)
    assert not [key for key in info if "path" in key or "tokenizer" in key]


# --- end to end -----------------------------------------------------------------------------------

pair_of = Callable[..., tuple[SimWorker, SimWorker]]


@pytest.fixture
def sglang_cluster(transactional_db: Any, gateway: Gateway, sim_pair: pair_of) -> Cluster:
    prefill, decode = sim_pair("sglang")
    cluster = register_cluster(
        prefill, decode, schedule_style=GENERATION_FIRST, protocol="sglang", context_options={"bootstrap_port": prefill.port}
    )
    wait_registered(gateway, cluster)
    return cluster


def payload(model: str, text: str, *, stream: bool) -> dict[str, Any]:
    return {"model": model, "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": text}]}


def duplicate_releases(gateway: Gateway) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    match = re.search(r"^gateway_duplicate_releases_total (\S+)$", text, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def legs(cluster: Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
    [prefill] = cluster.context.requests()
    [decode] = cluster.generation.requests()
    return prefill, decode


def assert_paired(cluster: Cluster) -> None:
    prefill, decode = legs(cluster)
    trio = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    assert [prefill[k] for k in trio] == [decode[k] for k in trio] == ["127.0.0.1", cluster.context.port, decode["bootstrap_room"]]
    assert 0 <= decode["bootstrap_room"] < 2**63
    assert prefill["stream"] is False and decode["stream"] is True
    assert prefill["messages"] == decode["messages"]


def assert_served_by_both(cluster: Cluster, request_id: str) -> None:
    assert_paired(cluster)
    prefill = cluster.context.wait_for(lambda s: s["completed"] == 1 and s["kv_taken"] == 1 and s["kv_held"] == 0)
    assert prefill["failed"] == prefill["aborted"] == 0
    cluster.generation.wait_for(lambda s: s["completed"] == 1 and s["active"] == 0)
    row = audit_row(request_id)
    assert (row.status, row.stage, row.output_tokens) == ("completed", "done", 5)
    assert (row.context_endpoint, row.generation_endpoint) == (cluster.context.url, cluster.generation.url)
    rows = reservations_closed(request_id)
    assert sorted((r.stage, r.outcome) for r in rows) == [("context", "success"), ("generation", "success")]


def test_non_streamed_answer(gateway: Gateway, sglang_cluster: Cluster) -> None:
    cluster = sglang_cluster
    response = httpx.post(
        gateway.url + "/v1/messages", json=payload(cluster.model, "hi [sim tokens=5]", stream=False), headers=cluster.headers(), timeout=30
    )
    assert response.status_code == 200, response.text
    message = response.json()
    # The decode's answer: the prefill answered one empty token, which is nowhere in it.
    assert message["usage"]["output_tokens"] == 5 and message["usage"]["input_tokens"] > 0
    assert message["stop_reason"] == "end_turn"
    assert [block["type"] for block in message["content"]] == ["text"] and message["content"][0]["text"]
    assert_served_by_both(cluster, response.headers["request-id"])


def test_streamed_answer(gateway: Gateway, sglang_cluster: Cluster) -> None:
    cluster = sglang_cluster
    stream = RawStream.post_json(gateway.url + "/v1/messages", payload(cluster.model, "hi [sim tokens=5]", stream=True), cluster.headers())
    frames = stream.read_all()
    assert stream.status == 200
    events = [f.event for f in frames if f.event != "ping"]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    start = frames[[f.event for f in frames].index("message_start")].data["message"]["usage"]
    # SGLang sends usage on every chunk (continuous_usage_stats), so message_start has the count.
    assert start["input_tokens"] > 0
    delta = [f.data for f in frames if f.event == "message_delta"][0]
    assert delta["usage"]["output_tokens"] == 5
    text = "".join(f.data["delta"].get("text", "") for f in frames if f.event == "content_block_delta")
    assert text
    assert_served_by_both(cluster, stream.response_headers["request-id"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_failure_fails_the_request_cleanly(gateway: Gateway, sglang_cluster: Cluster, stream: bool) -> None:
    cluster = sglang_cluster
    duplicates = duplicate_releases(gateway)
    raw = RawStream.post_json(gateway.url + "/v1/messages", payload(cluster.model, "hi [sim context_status=500]", stream=stream), cluster.headers())
    if stream and raw.read_head() == 200:
        error = raw.read_until("error").data
        raw.read_all()
        assert "message_stop" not in raw.events()
    else:
        error = raw.body_json()
        assert raw.status == 500
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert cluster.context.url not in str(error) and "127.0.0.1" not in str(error)
    request_id = raw.response_headers["request-id"]
    assert_paired(cluster)
    row = audit_row(request_id)
    assert (row.status, row.http_status, row.stage) == ("failed", 500, "context")
    from messages_api.models import MessageRequest

    assert MessageRequest.objects.filter(request_id=request_id).count() == 1
    rows = reservations_closed(request_id)
    assert sorted(r.stage for r in rows) == ["context", "generation"]
    assert {r.outcome for r in rows} == {"failure"}
    cluster.context.wait_for(lambda s: s["failed"] == 1 and s["active"] == 0)
    # The decode leg, waiting for the room, does not linger.
    cluster.generation.wait_for(lambda s: s["received"] == 1 and s["active"] == 0 and s["completed"] == 0)
    assert duplicate_releases(gateway) == duplicates


def test_a_client_leaving_mid_prefill_aborts_both_legs(gateway: Gateway, sglang_cluster: Cluster) -> None:
    cluster = sglang_cluster
    raw = RawStream.post_json(gateway.url + "/v1/messages", payload(cluster.model, "hi [sim context_delay=30]", stream=True), cluster.headers())
    cluster.context.wait_for(lambda s: s["active"] == 1)
    cluster.generation.wait_for(lambda s: s["active"] == 1 and s["kv_waiting"] == 0)
    cluster.context.wait_for(lambda s: s["kv_waiting"] == 1)  # the decode waits on the prefill's room
    assert raw.read_head() == 200  # the gateway answers a long prefill with pings
    request_id = raw.response_headers["request-id"]
    raw.close()
    cluster.context.wait_for(lambda s: s["aborted"] == 1 and s["active"] == 0 and s["kv_waiting"] == 0)
    # The gateway closes the decode leg as it closes the prefill leg; the decode sim sees either
    # that (aborted) or, a moment earlier, its prefill's abort through the room (failed). Either
    # way it ends now, long before its 30 s wait for the KV, and never answers.
    decode = cluster.generation.wait_for(lambda s: s["active"] == 0, timeout=5.0)
    assert (decode["received"], decode["completed"], decode["aborted"] + decode["failed"]) == (1, 0, 1)
    assert_paired(cluster)
    row = audit_row(request_id)
    assert (row.status, row.stage) == ("cancelled", "context")
    rows = reservations_closed(request_id)
    assert {r.outcome for r in rows} == {"cancelled"}


def test_without_a_bootstrap_port_the_decode_leg_is_refused(gateway: Gateway, transactional_db: Any, sim_pair: pair_of) -> None:
    """A prefill endpoint with no bootstrap_port configured: the router sends null, and a decode
    server cannot find the prefill; the request fails, without leaking the worker's words."""
    prefill, decode = sim_pair("sglang")
    cluster = register_cluster(prefill, decode, schedule_style=GENERATION_FIRST, protocol="sglang")
    wait_registered(gateway, cluster)
    response = httpx.post(gateway.url + "/v1/messages", json=payload(cluster.model, "hi", stream=False), headers=cluster.headers(), timeout=30)
    assert response.status_code >= 400
    assert "127.0.0.1" not in response.text
    _, decode_body = legs(cluster)
    assert decode_body["bootstrap_port"] is None
    wait_until(lambda: reservations_closed(response.headers["request-id"]))


def test_an_aggregated_pool_of_plain_sglang_servers(gateway: Gateway, transactional_db: Any, sim_pair: pair_of) -> None:
    """`aggregated`: SGLang servers run without disaggregation (a plain sim), generation
    endpoints only; the request goes whole, with usage on every chunk and no bootstrap fields."""
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    _, server = sim_pair("openai")
    pool = WorkerPool.objects.create(name="plain-sglang", model=MODEL, schedule_style=AGGREGATED, protocol="sglang")
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=server.url)
    _, key = create_api_key(f"plain-sglang-{time.monotonic_ns()}")
    server.reset()
    wait_until(lambda: httpx.get(gateway.url + "/ready", timeout=5).json()["pools"].get("plain-sglang", {}).get("id") == pool.id)
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}
    stream = RawStream.post_json(gateway.url + "/v1/messages", payload(MODEL, "hi [sim tokens=5]", stream=True), headers)
    frames = stream.read_all()
    assert stream.status == 200
    start = [f.data for f in frames if f.event == "message_start"][0]["message"]["usage"]
    assert start["input_tokens"] > 0
    [body] = server.requests()
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & body.keys()
    server.wait_for(lambda s: s["completed"] == 1 and s["active"] == 0)
    assert [(r.stage, r.outcome) for r in reservations_closed(stream.response_headers["request-id"])] == [("generation", "success")]


# --- against sglang-router -------------------------------------------------------------------------

# Each sim is registered with the router by URL; the router then reads /server_info and
# /model_info and would fetch a tokenizer for any model path found there. The sims report none,
# the router says so, and anything that reads like a fetch fails the test. Outbound HTTP from the
# router process also goes to a dead proxy, and Hugging Face Hub clients are told to stay offline.
NO_TOKENIZER = "No tokenizer_path or model_path found"
FETCH = re.compile(r"download|hugging|hf\.co|loading tokenizer|tokenizer (loaded|registered)|from_pretrained", re.IGNORECASE)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def sglang_router(sim_pair: pair_of, tmp_path: Any) -> Iterator[tuple[str, SimWorker, SimWorker, Callable[[], str]]]:
    prefill, decode = sim_pair("sglang")
    prefill.reset()
    decode.reset()
    port = unused_port()  # the router binds it itself
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "ALL_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    log_path = tmp_path / "router.log"
    command = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", prefill.url, str(prefill.port), "--decode", decode.url,
        "--host", "127.0.0.1", "--port", str(port), "--policy", "random", "--disable-retries",
    ]
    with open(log_path, "w") as log:
        router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def read_log() -> str:
        return ANSI.sub("", log_path.read_text(errors="replace"))

    try:
        # Both workers registered (each logs that it found no tokenizer to load).
        wait_until(lambda: read_log().count(NO_TOKENIZER) == 2, timeout=30, message="sglang-router never registered the sims")
        wait_until(lambda: router_healthy(url), timeout=30, message="sglang-router never became healthy")
        yield url, prefill, decode, read_log
    finally:
        stop_process(router)


def router_healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def bootstrap_of(body: dict[str, Any]) -> tuple[Any, Any, Any]:
    return body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_pairs_the_legs_as_sglang_router_does(
    gateway: Gateway, transactional_db: Any, sglang_router: tuple[str, SimWorker, SimWorker, Callable[[], str]], stream: bool
) -> None:
    router_url, prefill, decode, router_log = sglang_router
    text = "compare [sim tokens=6]"
    chat = {"model": MODEL, "max_tokens": 32, "stream": stream, "messages": [{"role": "user", "content": text}]}
    answer = httpx.post(router_url + "/v1/chat/completions", json=chat, timeout=30)
    assert answer.status_code == 200, answer.text
    [router_prefill] = prefill.requests()
    [router_decode] = decode.requests()

    cluster = register_cluster(prefill, decode, schedule_style=GENERATION_FIRST, protocol="sglang", context_options={"bootstrap_port": prefill.port})
    wait_registered(gateway, cluster)
    response = httpx.post(gateway.url + "/v1/messages", json=payload(cluster.model, text, stream=False), headers=cluster.headers(), timeout=30)
    assert response.status_code == 200, response.text
    ours_prefill, ours_decode = legs(cluster)

    # The same pairing: both legs name the prefill's host and configured bootstrap port, and one
    # room, a fresh one per request, inside 0..2^63-1.
    for first, second in ((router_prefill, router_decode), (ours_prefill, ours_decode)):
        assert bootstrap_of(first) == bootstrap_of(second)
        assert bootstrap_of(first)[:2] == ("127.0.0.1", prefill.port)
        assert 0 <= first["bootstrap_room"] < 2**63
    assert router_prefill["bootstrap_room"] != ours_prefill["bootstrap_room"]
    # The decode leg streams for both (the router streams it when the client streams); the
    # prefill leg is the router's client's choice and ours is always one JSON object.
    assert router_decode["stream"] is stream and ours_decode["stream"] is True
    assert router_prefill["stream"] is stream and ours_prefill["stream"] is False
    # The router's answer is the decode's, the prefill's dropped: the same text as ours.
    if stream:
        frames = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        router_text = "".join((c["choices"][0]["delta"].get("content") or "") for c in map(json.loads, frames) if c["choices"])
    else:
        router_text = answer.json()["choices"][0]["message"]["content"]
    assert router_text and router_text == response.json()["content"][0]["text"]

    log = router_log()
    assert log.count(NO_TOKENIZER) == 2
    assert not FETCH.search(log), [line for line in log.splitlines() if FETCH.search(line)]
