"""The simulated worker, as real processes over real sockets."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import pytest

from tests.support.simworkers import SimWorker, start_simworker

T = TypeVar("T")

MAX_CONTEXT = 2000
_ids = itertools.count(1000)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "options": {"type": "object"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "note": {"type": "string"},
            },
            "required": ["city", "days", "metric", "tags", "options", "unit"],
        },
    },
}
WEATHER_ARGS = {
    "city": "Paris",
    "days": 42,
    "metric": True,
    "tags": [],
    "options": {},
    "unit": "celsius",
}
CITY_TOOL = {  # Anthropic-shaped, as a gateway might pass it through
    "name": "lookup",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, SimWorker]]:
    specs: dict[str, tuple[str, dict[str, Any]]] = {
        "ctx": ("context", {"max_context_tokens": MAX_CONTEXT, "prefill_tokens_per_second": 1e6,
                            "kv_timeout": 10}),
        "gen": ("generation", {"max_context_tokens": MAX_CONTEXT, "tokens_per_second": 1000,
                               "kv_timeout": 10}),
        "short_ctx": ("context", {"kv_timeout": 0.5}),
    }
    with ThreadPoolExecutor(len(specs)) as pool:  # start them side by side: ~0.7 s each
        futures = {name: pool.submit(start_simworker, role, **opts)
                   for name, (role, opts) in specs.items()}
        started = {name: future.result() for name, future in futures.items()}
    yield started
    for worker in started.values():
        worker.stop()


@pytest.fixture
def ctx(workers: dict[str, SimWorker]) -> SimWorker:
    return workers["ctx"]


@pytest.fixture
def gen(workers: dict[str, SimWorker]) -> SimWorker:
    return workers["gen"]


@pytest.fixture(autouse=True)
def _fresh_counters(workers: dict[str, SimWorker]) -> None:
    for worker in workers.values():
        worker.reset()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as c:
        yield c


# -- helpers ----------------------------------------------------------------------------------


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": user(text), **fields}


def streamed(text: str, **fields: Any) -> dict[str, Any]:
    return chat(text, **{"stream": True, "stream_options": {"include_usage": True}, **fields})


async def await_stats(
    worker: SimWorker, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0
) -> dict[str, Any]:
    """wait_for without blocking this test's event loop (its requests must keep moving)."""
    return await asyncio.to_thread(worker.wait_for, predicate, timeout)


async def sse(response: httpx.Response) -> list[Any]:
    """The data of every SSE frame: parsed JSON, or the string "[DONE]"."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def post_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.json()]
        assert response.headers["content-type"].startswith("text/event-stream")
        return 200, await sse(response)


def content_of(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events if isinstance(e, dict) and e["choices"]
    )


async def context_only(
    client: httpx.AsyncClient, ctx: SimWorker, request_id: int, text: str = "hello world"
) -> httpx.Response:
    body = chat(text, disaggregated_params={"request_type": "context_only",
                                            "disagg_request_id": request_id})
    return await client.post(ctx.url + "/v1/chat/completions", json=body)


def generation_request(text: str, params: dict[str, Any], prompt_token_ids: list[int] | None = None,
                       **fields: Any) -> dict[str, Any]:
    body = streamed(text, disaggregated_params={**params, "request_type": "generation_only"}, **fields)
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = prompt_token_ids
    return body


def transceiver(ctx: SimWorker) -> str:
    """The context sim's KV endpoint as TensorRT-LLM reports it: not its HTTP URL."""
    return "tcp://" + ctx.url.removeprefix("http://")


def gen_first_params(ctx: SimWorker, request_id: int) -> dict[str, Any]:
    return {"ctx_request_id": request_id, "disagg_request_id": request_id,
            "ctx_info_endpoint": transceiver(ctx), "schedule_style": "generation_first"}


def post_generation_first(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker, request_id: int, text: str
) -> Coroutine[Any, Any, httpx.Response]:
    """The generation-first request for `request_id`, to `gen`, its KV to come from `ctx`."""
    return client.post(gen.url + "/v1/chat/completions", json=generation_request(text, gen_first_params(ctx, request_id)))


async def waiting_on_context(ctx: SimWorker, request: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """`request` (a generation-first one) started, once `ctx` has it waiting for its KV."""
    task = asyncio.create_task(request)
    await await_stats(ctx, lambda s: s["kv_waiting"] == 1)
    return task


# -- basics -----------------------------------------------------------------------------------


async def test_health_and_models(client: httpx.AsyncClient, gen: SimWorker) -> None:
    health = await client.get(gen.url + "/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    models = (await client.get(gen.url + "/v1/models")).json()
    assert models == {"object": "list", "data": [{"id": "sim-model", "object": "model",
                                                   "owned_by": "sim", "max_model_len": MAX_CONTEXT}]}
    assert (await client.get(gen.url + "/nope")).status_code == 404
    assert (await client.get(gen.url + "/v1/chat/completions")).status_code == 405


async def test_a_late_health_route_leaves_chat_served(client: httpx.AsyncClient, gen: SimWorker) -> None:
    assert (await client.post(gen.url + "/sim/health", json={"delay_s": -1})).status_code == 400
    assert (await client.post(gen.url + "/sim/health", json={"delay_s": "2"})).status_code == 400
    gen.health_delay(2.0)
    try:
        health = asyncio.create_task(client.get(gen.url + "/health"))
        chat = await client.post(gen.url + "/v1/chat/completions", json={
            "model": "sim-model", "messages": user("hi [sim tokens=3]"), "max_tokens": 5})
        assert chat.status_code == 200 and not health.done()  # served while /health still waits
        assert (await health).json() == {"status": "ok"}
    finally:
        gen.health_delay(0)


async def test_tokenize_matches_prompt_usage(client: httpx.AsyncClient, gen: SimWorker) -> None:
    counted = (await client.post(gen.url + "/tokenize", json={"model": "m", "messages": user("one two three")})).json()
    assert counted["max_model_len"] == MAX_CONTEXT
    assert counted["count"] == len(counted["tokens"])
    answer = (await client.post(gen.url + "/v1/chat/completions", json=chat("one two three"))).json()
    assert answer["usage"]["prompt_tokens"] == counted["count"]
    prompt = (await client.post(gen.url + "/tokenize", json={"prompt": "hello, world"})).json()
    assert prompt["count"] == 3  # "hello" "," "world"
    assert (await client.post(gen.url + "/tokenize", json={"nothing": 1})).status_code == 400


async def test_requests_log_and_stats(client: httpx.AsyncClient, gen: SimWorker) -> None:
    for word in ("first", "second"):
        await client.post(gen.url + "/v1/chat/completions", json=chat(word, max_tokens=2))
    bodies = gen.requests()
    assert [b["messages"][-1]["content"] for b in bodies] == ["first", "second"]
    assert bodies[-1]["max_tokens"] == 2
    stats = gen.stats()
    assert stats["role"] == "generation"
    assert {k: stats[k] for k in ("received", "completed", "aborted", "failed", "active")} == {
        "received": 2, "completed": 2, "aborted": 0, "failed": 0, "active": 0}


# -- context-first handoffs -------------------------------------------------------------------


async def test_context_only_issues_a_held_handoff(client: httpx.AsyncClient, ctx: SimWorker) -> None:
    request_id = next(_ids)
    response = await context_only(client, ctx, request_id, "hello world")
    assert response.status_code == 200
    answer = response.json()
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": ""}
    assert choice["finish_reason"] == "length"
    params = choice["disaggregated_params"]
    assert params["request_type"] == "context_only"
    assert params["ctx_request_id"] == params["disagg_request_id"] == request_id
    assert params["ctx_info_endpoint"] == transceiver(ctx)
    assert isinstance(params["encoded_opaque_state"], str) and params["encoded_opaque_state"]
    assert len(params["first_gen_tokens"]) == 1
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert len(answer["prompt_token_ids"]) == prompt_tokens
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                               "total_tokens": prompt_tokens + 1,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert ctx.stats()["kv_held"] == 1

    take = await client.post(ctx.url + "/sim/kv/take", json={
        "ctx_request_id": request_id, "encoded_opaque_state": params["encoded_opaque_state"]})
    assert take.status_code == 200
    assert take.json()["status"] == "taken" and take.json()["prompt_tokens"] == prompt_tokens
    again = await client.post(ctx.url + "/sim/kv/take", json={
        "ctx_request_id": request_id, "encoded_opaque_state": params["encoded_opaque_state"]})
    assert (again.status_code, again.json()["status"]) == (404, "not_issued")
    stats = ctx.stats()
    assert (stats["kv_held"], stats["kv_taken"], stats["completed"]) == (0, 1, 1)


async def test_context_first_generation_streams(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    request_id = next(_ids)
    ctx_answer = (await context_only(client, ctx, request_id, "tell me [sim tokens=5]")).json()
    assert ctx.stats()["kv_held"] == 1
    params = ctx_answer["choices"][0]["disaggregated_params"]
    body = generation_request("tell me [sim tokens=5]", params, ctx_answer["prompt_token_ids"])
    status, events = await post_stream(client, gen.url, body)
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 5
    # As in vLLM, the last token's chunk carries the finish reason.
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
    assert chunks[-2] is tokens[-1] and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    prompt_tokens = ctx_answer["usage"]["prompt_tokens"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                                   "total_tokens": prompt_tokens + 5}
    ctx_stats = ctx.stats()
    assert (ctx_stats["kv_held"], ctx_stats["kv_taken"]) == (0, 1)
    assert gen.stats()["completed"] == 1
    # The same prompt served aggregated gives the same text.
    status, plain = await post_stream(client, gen.url, streamed("tell me [sim tokens=5]"))
    assert content_of(plain) == content_of(events)


async def test_forged_or_unknown_handoff_is_rejected(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    request_id = next(_ids)
    ctx_answer = (await context_only(client, ctx, request_id)).json()
    real = ctx_answer["choices"][0]["disaggregated_params"]
    forged = {**real, "encoded_opaque_state": "c2lta3YxOmZvcmdlZA=="}
    unknown = {**real, "ctx_request_id": next(_ids), "disagg_request_id": 1}
    nowhere = {**real, "ctx_info_endpoint": None}
    for params in (forged, unknown, nowhere):
        response = await client.post(gen.url + "/v1/chat/completions",
                                     json=generation_request("hello world", params, [1, 2, 3]))
        assert response.status_code == 400, params
        error = response.json()["error"]
        assert "was not issued by a context worker" in error["message"]
        assert error["type"] == "BadRequestError"
    assert ctx.stats()["kv_held"] == 1  # the forged take did not consume the real handoff
    ok = await client.post(gen.url + "/v1/chat/completions", json=generation_request(
        "hello world", real, ctx_answer["prompt_token_ids"], stream=False))
    assert ok.status_code == 200
    assert ok.json()["usage"]["prompt_tokens"] == ctx_answer["usage"]["prompt_tokens"]
    assert gen.stats()["failed"] == 3 and gen.stats()["completed"] == 1
    assert ctx.stats()["kv_held"] == 0


async def test_prompt_ids_must_match_the_prefilled_kv(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    ctx_answer = (await context_only(client, ctx, next(_ids), "hello world")).json()
    params = ctx_answer["choices"][0]["disaggregated_params"]
    wrong = await client.post(gen.url + "/v1/chat/completions",
                              json=generation_request("hello world", params, [1, 2, 3]))
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "prompt_token_ids"


async def test_role_must_match_request_type(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    wrong = await context_only(client, gen, next(_ids))
    assert wrong.status_code == 400 and "cannot serve request_type context_only" in wrong.text
    body = generation_request("hi", gen_first_params(ctx, next(_ids)))
    assert (await client.post(ctx.url + "/v1/chat/completions", json=body)).status_code == 400


async def test_handoff_expires_after_kv_timeout(
    client: httpx.AsyncClient, workers: dict[str, SimWorker], gen: SimWorker
) -> None:
    short_ctx = workers["short_ctx"]
    request_id = next(_ids)
    ctx_answer = (await context_only(client, short_ctx, request_id)).json()
    assert short_ctx.stats()["kv_held"] == 1
    await await_stats(short_ctx, lambda s: s["kv_expired"] == 1 and s["kv_held"] == 0, 3.0)
    params = ctx_answer["choices"][0]["disaggregated_params"]
    late = await client.post(gen.url + "/v1/chat/completions",
                             json=generation_request("hello world", params, [1]))
    assert late.status_code == 400
    assert "expired" in late.json()["error"]["message"]


# -- generation-first rendezvous --------------------------------------------------------------


async def test_generation_first_rendezvous(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    request_id = next(_ids)
    text = "rendezvous please [sim context_delay=0.2 tokens=4]"
    body = generation_request(text, gen_first_params(ctx, request_id))
    gen_task = await waiting_on_context(ctx, post_stream(client, gen.url, body))
    assert not gen_task.done()
    started = time.monotonic()
    ctx_response = await context_only(client, ctx, request_id, text)
    assert ctx_response.status_code == 200
    assert time.monotonic() - started >= 0.2
    status, events = await gen_task
    assert status == 200 and events[-1] == "[DONE]"
    assert len(content_of(events).split()) == 4
    stats = ctx.stats()
    assert (stats["kv_held"], stats["kv_taken"], stats["kv_waiting"]) == (0, 1, 0)


async def test_generation_first_fails_fast_when_context_fails(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    request_id = next(_ids)
    text = "doomed [sim context_delay=0.1 context_status=503]"
    gen_task = await waiting_on_context(ctx, post_generation_first(client, ctx, gen, request_id, text))
    started = time.monotonic()
    ctx_response = await context_only(client, ctx, request_id, text)
    assert ctx_response.status_code == 503
    assert ctx_response.json()["error"]["message"] == "Service Unavailable (simulated)"
    gen_response = await gen_task
    assert time.monotonic() - started < 2.0  # not the 10 s kv-timeout
    assert gen_response.status_code == 500
    assert f"context phase for request {request_id} failed" in gen_response.json()["error"]["message"]
    # A take arriving after the failure fails at once too.
    late = await post_generation_first(client, ctx, gen, request_id, text)
    assert late.status_code == 500
    assert gen.stats()["failed"] == 2 and ctx.stats()["failed"] == 1


async def test_generation_first_waiter_stops_when_its_client_leaves(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    request_id = next(_ids)
    gen_task = await waiting_on_context(ctx, post_generation_first(client, ctx, gen, request_id, "hi"))
    gen_task.cancel()
    await await_stats(gen, lambda s: s["aborted"] == 1 and s["active"] == 0)
    await await_stats(ctx, lambda s: s["kv_waiting"] == 0)


# -- aborts and faults ------------------------------------------------------------------------


async def test_context_client_disconnect_during_prefill(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    request_id = next(_ids)
    text = "slow prefill [sim context_delay=30]"
    waiter = await waiting_on_context(ctx, post_generation_first(client, ctx, gen, request_id, text))
    ctx_task = asyncio.create_task(context_only(client, ctx, request_id, text))
    await await_stats(ctx, lambda s: s["active"] == 1)
    ctx_task.cancel()
    stats = await await_stats(ctx, lambda s: s["aborted"] == 1 and s["active"] == 0)
    assert stats["kv_held"] == 0 and stats["completed"] == 0
    gen_response = await waiter  # its rendezvous failed with the abort
    assert gen_response.status_code == 500
    assert "aborted" in gen_response.json()["error"]["message"]


async def test_gen_client_disconnect_mid_stream(client: httpx.AsyncClient, gen: SimWorker) -> None:
    async with client.stream("POST", gen.url + "/v1/chat/completions",
                             json=streamed("long one [sim tokens=5000]")) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 4:
                break
    stats = await await_stats(gen, lambda s: s["aborted"] == 1 and s["active"] == 0)
    assert stats["completed"] == 0


async def test_over_length_is_rejected_at_once(
    client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker
) -> None:
    text = "[sim context_delay=5] " + "word " * MAX_CONTEXT
    count = (await client.post(gen.url + "/tokenize", json={"messages": user(text)})).json()["count"]
    assert count > MAX_CONTEXT + 1
    # vLLM's wording: it tokenizes only up to one token past the window ("at least").
    expected = {
        "message": f"This model's maximum context length is {MAX_CONTEXT} tokens. However, your "
                   f"prompt contains at least {MAX_CONTEXT + 1} input tokens, which exceeds this limit "
                   f"even without any output tokens. Please reduce the length of the input prompt. "
                   f"(parameter=input_tokens, value={MAX_CONTEXT + 1})",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    started = time.monotonic()
    plain = await client.post(gen.url + "/v1/chat/completions", json=streamed(text))
    ctx_only = await context_only(client, ctx, next(_ids), text)
    assert time.monotonic() - started < 2.0
    for response in (plain, ctx_only):
        assert response.status_code == 400
        assert response.json() == {"error": expected}
    assert gen.stats()["failed"] == 1 and ctx.stats()["failed"] == 1


async def test_status_faults(client: httpx.AsyncClient, ctx: SimWorker, gen: SimWorker) -> None:
    ctx_response = await context_only(client, ctx, next(_ids), "hi [sim context_status=502]")
    assert ctx_response.status_code == 502
    assert ctx_response.json()["error"]["type"] == "Bad Gateway"
    assert ctx.stats()["kv_held"] == 0
    gen_response = await client.post(gen.url + "/v1/chat/completions",
                                      json=streamed("hi [sim gen_delay=0.05] [sim gen_status=429]"))
    assert gen_response.status_code == 429
    assert gen_response.headers["content-type"] == "application/json"
    assert gen_response.json()["error"] == {"message": "Too Many Requests (simulated)",
                                            "type": "Too Many Requests", "param": None,
                                            "code": 429}
    assert ctx.stats()["failed"] == 1 and gen.stats()["failed"] == 1


async def test_gen_fail_after_drops_the_connection(client: httpx.AsyncClient, gen: SimWorker) -> None:
    events: list[Any] = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", gen.url + "/v1/chat/completions",
                                 json=streamed("break [sim gen_fail_after=3 tokens=10]")) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
    assert len(events) == 4  # the role chunk and 3 tokens; no finish, no [DONE]
    assert "data: [DONE]" not in events
    await await_stats(gen, lambda s: s["failed"] == 1 and s["active"] == 0)


# -- output shapes ----------------------------------------------------------------------------


async def test_length_and_continuous_usage(client: httpx.AsyncClient, gen: SimWorker) -> None:
    body = chat("count [sim tokens=10]", max_tokens=4, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    _, events = await post_stream(client, gen.url, body)
    chunks = events[:-1]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4, 4]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_reasoning(client: httpx.AsyncClient, gen: SimWorker) -> None:
    text = "think first [sim reasoning=3 tokens=2]"
    _, events = await post_stream(client, gen.url, streamed(text))
    deltas = [e["choices"][0]["delta"] for e in events[1:-1] if e["choices"]]
    kinds = [next(iter(d)) for d in deltas if d]
    assert kinds == ["reasoning"] * 3 + ["content"] * 2
    answer = (await client.post(gen.url + "/v1/chat/completions", json=chat(text))).json()
    message = answer["choices"][0]["message"]
    assert len(message["reasoning"].split()) == 3 and len(message["content"].split()) == 2
    assert answer["usage"]["completion_tokens"] == 5


def tool_deltas(events: list[Any]) -> list[dict[str, Any]]:
    return [call for e in events if isinstance(e, dict) and e["choices"]
            for call in e["choices"][0]["delta"].get("tool_calls", [])]


def assemble(calls: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for call in calls:
        entry = out.setdefault(call["index"], {"name": "", "arguments": ""})
        entry["name"] += call.get("function", {}).get("name", "")
        entry["arguments"] += call["function"]["arguments"]
    return out


async def test_tool_call_arguments_follow_the_schema(client: httpx.AsyncClient, gen: SimWorker) -> None:
    text = "weather? [sim tool_call=get_weather]"
    _, events = await post_stream(client, gen.url, streamed(text, tools=[WEATHER_TOOL]))
    calls = tool_deltas(events)
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(calls) >= 4  # the header and 3+ argument fragments
    assert json.loads(assemble(calls)[0]["arguments"]) == WEATHER_ARGS
    assert content_of(events) == ""
    finish = [e for e in events if isinstance(e, dict) and e["choices"]][-1]
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    answer = (await client.post(gen.url + "/v1/chat/completions",
                                json=chat(text, tools=[WEATHER_TOOL, CITY_TOOL]))).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == WEATHER_ARGS
    other = (await client.post(gen.url + "/v1/chat/completions",
                               json=chat("[sim tool_call=lookup]", tools=[CITY_TOOL]))).json()
    assert json.loads(other["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


async def test_two_interleaved_tool_calls(client: httpx.AsyncClient, gen: SimWorker) -> None:
    body = streamed("both [sim tool_calls=2 tool_call=get_weather]", tools=[WEATHER_TOOL])
    _, events = await post_stream(client, gen.url, body)
    calls = tool_deltas(events)
    indices = [c["index"] for c in calls]
    # Both headers, then argument pieces alternating between the two calls.
    assert indices[:8] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert "id" in calls[0] and "id" in calls[1]
    assembled = assemble(calls)
    assert set(assembled) == {0, 1}
    assert all(json.loads(c["arguments"]) == WEATHER_ARGS for c in assembled.values())
    ids = [c["id"] for c in calls if "id" in c]
    assert len(set(ids)) == 2


async def test_invalid_tool_arguments(client: httpx.AsyncClient, gen: SimWorker) -> None:
    body = chat("[sim tool_call=lookup tool_args=invalid]", tools=[CITY_TOOL])
    answer = (await client.post(gen.url + "/v1/chat/completions", json=body)).json()
    arguments = answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert arguments == '{"city": "Par'
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


async def test_stop_string_cuts_the_text(client: httpx.AsyncClient, gen: SimWorker) -> None:
    text = "[sim say=hello_world_STOP_more]"
    _, events = await post_stream(client, gen.url, streamed(text, stop=["nope", "STOP"]))
    assert content_of(events) == "hello world "
    finish = [e for e in events if isinstance(e, dict) and e["choices"]][-1]["choices"][0]
    assert (finish["finish_reason"], finish["stop_reason"]) == ("stop", "STOP")
    answer = (await client.post(gen.url + "/v1/chat/completions", json=chat(text, stop="STOP"))).json()
    choice = answer["choices"][0]
    assert choice["message"]["content"] == "hello world "
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "STOP")
    unstopped = (await client.post(gen.url + "/v1/chat/completions", json=chat(text))).json()
    assert unstopped["choices"][0]["message"]["content"] == "hello world STOP more"


async def test_output_is_deterministic_and_has_utf8(client: httpx.AsyncClient, gen: SimWorker) -> None:
    texts = []
    for _ in range(2):
        _, events = await post_stream(client, gen.url, streamed("same prompt [sim tokens=64]"))
        texts.append(content_of(events))
    assert texts[0] == texts[1]
    assert len(texts[0].split(" ")) == 64
    assert any(not word.isascii() for word in texts[0].split())
    _, other = await post_stream(client, gen.url, streamed("another prompt [sim tokens=64]"))
    assert content_of(other) != texts[0]
