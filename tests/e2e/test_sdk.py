"""The official `anthropic` Python SDK against the real gateway (daphne) and real sim workers.

Everything here goes through the SDK's own request building, response parsing, stream decoding,
stream accumulation and error mapping, so a reply the SDK would reject (wrong event order, a
missing field, an error without the right status) fails here even where the raw-HTTP tests pass.
Most tests use the `cluster` fixture and so run in both schedule orders.

The installed SDK (2.x) sends the key as `Authorization: Bearer` and `anthropic-version:
2026-10-21`; `test_x_api_key_and_the_older_version_header` covers the other spelling.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types import Message

from tests.support.cluster import (
    Cluster,
    audit_row,
    reservations_closed,
    wait_registered,
    wait_until,
)
from tests.support.gateway import START_WAIT, Gateway
from tests.support.sdk import sdk_client, sdk_message

LATE = 1.0  # a context phase this long outlasts the stream-start wait of the test gateways
assert LATE > START_WAIT + 0.5

# For what happens before the pipeline runs (auth, routing, listing, counting) the schedule order
# does not matter: run those once.
ONE_ORDER = pytest.mark.parametrize("schedule_style", ["context_first"])

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}
BAD_TOOL_ARGUMENTS = "The worker returned tool call arguments that are not a JSON object"


@pytest.fixture
def client(gateway: Gateway, cluster: Cluster) -> Iterator[anthropic.Anthropic]:
    with sdk_client(gateway.url, cluster.key) as c:
        yield c


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def texts(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# --- plain text ----------------------------------------------------------------------------------


def test_create_non_streamed(client: anthropic.Anthropic, cluster: Cluster) -> None:
    message = client.messages.create(model=cluster.model, max_tokens=64, messages=ask("Hello there [sim tokens=6]"))
    assert isinstance(message, Message)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == cluster.model
    assert [block.type for block in message.content] == ["text"]
    assert len(message.content[0].text.split()) == 6
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens == 6
    assert message.usage.cache_read_input_tokens == 0 and message.usage.cache_creation_input_tokens == 0
    assert message._request_id is not None and message._request_id.startswith("req_")
    row = audit_row(message._request_id)
    assert row.status == "completed" and not row.stream and row.output_tokens == 6
    assert {r.outcome for r in reservations_closed(row.request_id)} == {"success"}


@ONE_ORDER
def test_request_id_header_via_raw_response(client: anthropic.Anthropic, cluster: Cluster) -> None:
    raw = client.messages.with_raw_response.create(model=cluster.model, max_tokens=16, messages=ask("hi [sim tokens=2]"))
    assert raw.status_code == 200
    assert raw.headers["content-type"].startswith("application/json")
    assert raw.headers["request-id"].startswith("req_")
    message = raw.parse()
    assert message._request_id == raw.headers["request-id"]
    assert message.usage.output_tokens == 2


def test_create_streamed_raw_events(client: anthropic.Anthropic, cluster: Cluster) -> None:
    with client.messages.create(
        model=cluster.model, max_tokens=64, stream=True, messages=ask("Stream please [sim tokens=5]")
    ) as stream:
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        request_id = stream.response.headers["request-id"]
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * 5 + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0].message
    assert start.id.startswith("msg_") and start.model == cluster.model and start.stop_reason is None
    assert start.usage.input_tokens > 0
    assert events[1].content_block.type == "text" and events[1].index == 0
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert len(text.split()) == 5
    delta = events[-2]
    assert delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == 5
    row = audit_row(request_id)
    assert row.status == "completed" and row.stream and row.output_tokens == 5


def test_stream_helper_text_stream_and_final_message(client: anthropic.Anthropic, cluster: Cluster) -> None:
    prompt = ask("The same prompt twice [sim tokens=7]")
    with client.messages.stream(model=cluster.model, max_tokens=64, messages=prompt) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(streamed.split()) == 7
    assert texts(final) == streamed
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 7 and final.usage.input_tokens > 0
    # The sim's output depends only on the prompt: the JSON answer must say the same thing.
    whole = client.messages.create(model=cluster.model, max_tokens=64, messages=prompt)
    assert texts(whole) == streamed
    assert whole.usage.input_tokens == final.usage.input_tokens
    assert whole.usage.output_tokens == final.usage.output_tokens


def test_slow_context_stream_starts_with_pings(client: anthropic.Anthropic, cluster: Cluster) -> None:
    """The gateway answers 200 and pings before `message_start` while the context phase runs; the
    SDK must skip those pings and accumulate the message that follows."""
    with client.messages.stream(
        model=cluster.model, max_tokens=32, messages=ask(f"slow [sim context_delay={LATE} tokens=3]")
    ) as stream:
        request_id = stream.response.headers["request-id"]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(text.split()) == 3 and texts(final) == text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3
    row = audit_row(request_id)
    assert row.status == "completed" and row.pings_sent >= 1


def test_system_prompt_and_multi_turn_reach_the_worker(client: anthropic.Anthropic, cluster: Cluster) -> None:
    message = client.messages.create(
        model=cluster.model,
        max_tokens=32,
        system=[{"type": "text", "text": "You are terse."}],
        metadata={"user_id": "user-42"},
        messages=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "second [sim tokens=3]"}]},
        ],
    )
    assert message.usage.output_tokens == 3
    sent = cluster.generation.requests()[-1]
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "user"]
    assert sent["messages"][0]["content"] == "You are terse."
    assert sent["user"] == "user-42"


# --- tools -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_tool_use_and_tool_result_round_trip(client: anthropic.Anthropic, cluster: Cluster, streamed: bool) -> None:
    request: dict[str, Any] = {
        "model": cluster.model,
        "max_tokens": 256,
        "tools": [WEATHER_TOOL],
        "messages": ask("What is the weather in Paris? [sim tool_call=get_weather]"),
    }
    events: list[Any] = []
    first = sdk_message(client, streamed, events=events, **request)
    if streamed:
        json_deltas = [e for e in events if e.type == "input_json"]
        assert json_deltas, "the tool input was not streamed"
    assert first.stop_reason == "tool_use"
    tool_uses = [block for block in first.content if block.type == "tool_use"]
    assert len(tool_uses) == 1
    call = tool_uses[0]
    assert call.name == "get_weather" and call.id
    assert isinstance(call.input, dict) and call.input == {"city": "Paris"}

    # The worker got the tool as an OpenAI function.
    sent = cluster.generation.requests()[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER_TOOL["description"],
                "parameters": WEATHER_TOOL["input_schema"],
            },
        }
    ]

    follow_up = client.messages.create(
        model=cluster.model,
        max_tokens=64,
        tools=[WEATHER_TOOL],
        messages=[
            request["messages"][0],
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 °C"},
                    {"type": "text", "text": "Summarise that [sim tokens=4]"},
                ],
            },
        ],
    )
    assert follow_up.stop_reason == "end_turn"
    assert [block.type for block in follow_up.content] == ["text"]
    assert follow_up.usage.output_tokens == 4
    sent = cluster.generation.requests()[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "user"]
    assert sent[1]["tool_calls"][0]["id"] == call.id
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent[1]["tool_calls"][0]["function"]["arguments"].replace(" ", "") == '{"city":"Paris"}'
    assert sent[2] == {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 °C"}


def test_tool_result_turn_does_not_repeat_the_directive(client: anthropic.Anthropic, cluster: Cluster) -> None:
    """A turn that only returns tool results carries no directive of its own: the sim's docstring
    promises that a directive earlier in the conversation does not fire again. Claude Code sends
    exactly such turns, so with the bug it calls the tool forever."""
    prompt = ask("What is the weather in Paris? [sim tool_call=get_weather]")
    first = client.messages.create(model=cluster.model, max_tokens=256, tools=[WEATHER_TOOL], messages=prompt)
    call = first.content[0]
    assert call.type == "tool_use"
    follow_up = client.messages.create(
        model=cluster.model,
        max_tokens=256,
        tools=[WEATHER_TOOL],
        messages=[
            *prompt,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]},
        ],
    )
    assert [m["role"] for m in cluster.generation.requests()[-1]["messages"]] == ["user", "assistant", "tool"]
    assert follow_up.stop_reason == "end_turn"
    assert [block.type for block in follow_up.content] == ["text"]


def test_invalid_tool_arguments_non_streamed_are_a_500(client: anthropic.Anthropic, cluster: Cluster) -> None:
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(
            model=cluster.model,
            max_tokens=256,
            tools=[WEATHER_TOOL],
            messages=ask("weather? [sim tool_call=get_weather tool_args=invalid]"),
        )
    error = caught.value
    assert error.status_code == 500 and error.type == "api_error"
    assert error.api_message == BAD_TOOL_ARGUMENTS
    assert error.request_id is not None and error.request_id.startswith("req_")
    row = audit_row(error.request_id)
    assert row.status == "failed" and row.http_status == 500


def test_invalid_tool_arguments_streamed_are_an_error_event(client: anthropic.Anthropic, cluster: Cluster) -> None:
    seen: list[Any] = []
    with client.messages.create(
        model=cluster.model,
        max_tokens=256,
        stream=True,
        tools=[WEATHER_TOOL],
        messages=ask("weather? [sim tool_call=get_weather tool_args=invalid]"),
    ) as stream:
        request_id = stream.response.headers["request-id"]
        with pytest.raises(anthropic.APIStatusError) as caught:
            seen.extend(stream)
    error = caught.value
    assert error.status_code == 200  # the stream had started: the SDK builds it from the 200
    assert error.type == "api_error" and error.api_message == BAD_TOOL_ARGUMENTS
    assert BAD_TOOL_ARGUMENTS in str(error)
    kinds = [e.type for e in seen]
    assert kinds[0] == "message_start" and "message_stop" not in kinds and "message_delta" not in kinds
    assert seen[1].type == "content_block_start" and seen[1].content_block.type == "tool_use"
    assert kinds[-1] == "content_block_stop"  # the open block is closed before the error
    row = audit_row(request_id)
    assert row.status == "failed" and row.http_status == 200 and row.error_type == "api_error"


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_thinking_text_and_parallel_tool_calls(client: anthropic.Anthropic, cluster: Cluster, streamed: bool) -> None:
    """Upstream interleaves the two calls' argument fragments; the SDK needs contiguous blocks."""
    request: dict[str, Any] = {
        "model": cluster.model,
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [WEATHER_TOOL],
        "messages": ask("Two cities [sim reasoning=3 tokens=2 tool_call=get_weather tool_calls=2]"),
    }
    message = sdk_message(client, streamed, **request)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    calls = message.content[2:]
    assert all(call.name == "get_weather" and call.input == {"city": "Paris"} for call in calls)
    assert len({call.id for call in calls}) == 2
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_tool_call_cut_by_max_tokens_is_max_tokens(client: anthropic.Anthropic, cluster: Cluster, streamed: bool) -> None:
    """The API answers a turn truncated inside a tool call with 200, stop_reason `max_tokens` and the
    incomplete tool_use block; clients (Claude Code included) then retry with a larger max_tokens.
    A 500 instead makes every SDK retry the same request, and fail the same way."""
    request: dict[str, Any] = {
        "model": cluster.model,
        "max_tokens": 3,  # the call's header and two of its three argument fragments
        "tools": [WEATHER_TOOL],
        "messages": ask("weather? [sim tool_call=get_weather]"),
    }
    message = sdk_message(client, streamed, **request)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3
    assert [block.type for block in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather" and isinstance(message.content[0].input, dict)


# --- thinking, stop sequences, max_tokens ------------------------------------------------------------


def test_thinking_block_then_text(client: anthropic.Anthropic, cluster: Cluster) -> None:
    request: dict[str, Any] = {
        "model": cluster.model,
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": ask("Think first [sim reasoning=5 tokens=4]"),
    }
    message = client.messages.create(**request)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert len(message.content[0].thinking.split()) == 5
    assert len(message.content[1].text.split()) == 4
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 9
    sent = cluster.generation.requests()[-1]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert sent["thinking_token_budget"] == 1024

    events: list[Any] = []
    final = sdk_message(client, True, events=events, **request)
    thinking = "".join(e.thinking for e in events if e.type == "thinking")
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thinking == message.content[0].thinking
    assert final.content[1].text == message.content[1].text

    # Sending the thinking block back (as Claude Code does) reaches the worker as reasoning.
    client.messages.create(
        **{
            **request,
            "messages": [
                *request["messages"],
                {"role": "assistant", "content": final.content},
                {"role": "user", "content": "and now? [sim tokens=2]"},
            ],
        }
    )
    assistant = cluster.generation.requests()[-1]["messages"][1]
    assert assistant["role"] == "assistant"
    assert assistant["reasoning_content"] == thinking and assistant["content"] == final.content[1].text


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_stop_sequence(client: anthropic.Anthropic, cluster: Cluster, streamed: bool) -> None:
    request: dict[str, Any] = {
        "model": cluster.model,
        "max_tokens": 64,
        "stop_sequences": ["STOP"],
        "messages": ask("Say it [sim say=alpha_beta_STOP_gamma]"),
    }
    message = sdk_message(client, streamed, **request)
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "STOP"
    assert texts(message) == "alpha beta "
    assert cluster.generation.requests()[-1]["stop"] == ["STOP"]


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_max_tokens_cut(client: anthropic.Anthropic, cluster: Cluster, streamed: bool) -> None:
    request: dict[str, Any] = {"model": cluster.model, "max_tokens": 5, "messages": ask("Go on [sim tokens=50]")}
    message = sdk_message(client, streamed, **request)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 5
    assert len(texts(message).split()) == 5


# --- errors ----------------------------------------------------------------------------------------

# status from the context worker → (SDK exception class, Anthropic error type)
WORKER_ERRORS = {
    400: (anthropic.BadRequestError, "invalid_request_error"),
    429: (anthropic.RateLimitError, "rate_limit_error"),
    500: (anthropic.InternalServerError, "api_error"),
    503: (anthropic.ServiceUnavailableError, "overloaded_error"),
    529: (anthropic.OverloadedError, "overloaded_error"),
}
RETRY_AFTER = {429, 503, 529}


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("status", sorted(WORKER_ERRORS))
def test_worker_error_status_is_the_typed_exception(
    client: anthropic.Anthropic, cluster: Cluster, status: int, streamed: bool
) -> None:
    exception, error_type = WORKER_ERRORS[status]
    with pytest.raises(anthropic.APIStatusError) as caught:
        # Fails within the stream-start wait, so a streamed request gets the HTTP status too.
        client.messages.create(
            model=cluster.model, max_tokens=32, stream=streamed, messages=ask(f"hi [sim context_status={status}]")
        )
    error = caught.value
    assert type(error) is exception, type(error)
    if status >= 500:
        assert isinstance(error, anthropic.InternalServerError)
    assert error.status_code == status
    assert error.type == error_type
    assert error.api_message
    assert error.response.headers["content-type"] == "application/json"
    assert error.request_id is not None and error.request_id.startswith("req_")
    assert isinstance(error.body, dict) and error.body["request_id"] == error.request_id
    if status in RETRY_AFTER:
        assert int(error.response.headers["retry-after"]) >= 1
    else:
        assert "retry-after" not in error.response.headers
    row = audit_row(error.request_id)
    assert row.status == "failed" and row.http_status == status and row.error_type == error_type


@ONE_ORDER
def test_bad_key_is_authentication_error(gateway: Gateway, cluster: Cluster) -> None:
    with sdk_client(gateway.url, "sk-gw-not-a-real-key") as bad, pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model=cluster.model, max_tokens=16, messages=ask("hi"))
    error = caught.value
    assert error.status_code == 401 and error.type == "authentication_error"
    assert error.request_id is not None and error.request_id.startswith("req_")
    assert cluster.context.requests() == [] and cluster.generation.requests() == []


@ONE_ORDER
def test_unknown_model_is_not_found(client: anthropic.Anthropic, cluster: Cluster) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=16, messages=ask("hi"))
    assert caught.value.status_code == 404 and caught.value.type == "not_found_error"
    assert "no-such-model" in (caught.value.api_message or "")
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")


@ONE_ORDER
def test_invalid_request_is_bad_request(client: anthropic.Anthropic, cluster: Cluster) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=cluster.model,
            max_tokens=1024,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=ask("hi"),
        )
    assert caught.value.type == "invalid_request_error"
    assert caught.value.api_message == "`max_tokens` must be greater than `thinking.budget_tokens`"


@ONE_ORDER
def test_prompt_too_long_keeps_the_wording_claude_code_matches(client: anthropic.Anthropic, cluster: Cluster) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=cluster.model, max_tokens=16, messages=ask("word " * 5000))
    assert caught.value.type == "invalid_request_error"
    assert (caught.value.api_message or "").startswith("prompt is too long: ")
    assert (caught.value.api_message or "").endswith(" tokens > 4096 maximum")


@ONE_ORDER
def test_body_over_the_limit_is_413(gateways: Any, cluster: Cluster) -> None:
    small = gateways(MESSAGES_MAX_BODY_BYTES="100000")
    wait_registered(small, cluster)
    with sdk_client(small.url, cluster.key) as limited:
        # Under the limit it serves as usual.
        ok = limited.messages.create(model=cluster.model, max_tokens=16, messages=ask("short [sim tokens=2]"))
        assert ok.usage.output_tokens == 2
        with pytest.raises(anthropic.APIStatusError) as caught:
            limited.messages.create(model=cluster.model, max_tokens=16, messages=ask("word " * 40_000))
    error = caught.value
    assert isinstance(error, anthropic.RequestTooLargeError)  # alias of ContentTooLargeError
    assert error.status_code == 413 and error.type == "request_too_large"
    assert "100000" in (error.api_message or "")


@pytest.mark.parametrize("status", [400, 503])
def test_late_failure_raises_with_the_fast_failures_message(
    client: anthropic.Anthropic, patient_gateway: Gateway, cluster: Cluster, status: int
) -> None:
    wait_registered(patient_gateway, cluster)
    with sdk_client(patient_gateway.url, cluster.key) as patient, pytest.raises(anthropic.APIStatusError) as fast_caught:
        patient.messages.create(model=cluster.model, max_tokens=32, stream=True, messages=ask(f"hi [sim context_status={status}]"))
    fast = fast_caught.value
    assert fast.status_code == status

    # The context phase outlasts the stream-start wait: the 200 and the first ping are out.
    stream = client.messages.create(
        model=cluster.model,
        max_tokens=32,
        stream=True,
        messages=ask(f"hi [sim context_delay={LATE} context_status={status}]"),
    )
    assert stream.response.status_code == 200
    request_id = stream.response.headers["request-id"]
    with stream, pytest.raises(anthropic.APIStatusError) as late_caught:
        for _ in stream:
            pass
    late = late_caught.value
    assert late.status_code == 200
    assert late.type == fast.type
    assert late.api_message == fast.api_message
    assert fast.api_message and fast.api_message in str(late)
    assert late.request_id == request_id
    row = audit_row(request_id)
    assert row.status == "failed" and row.http_status == 200 and row.pings_sent >= 1

    if status != 503:
        return
    # The helper raises the same way.
    again = ask(f"again [sim context_delay={LATE} context_status={status}]")
    with (
        client.messages.stream(model=cluster.model, max_tokens=32, messages=again) as helper,
        pytest.raises(anthropic.APIStatusError) as helper_caught,
    ):
        helper.get_final_message()
    assert helper_caught.value.api_message == fast.api_message


# --- count_tokens, models, beta --------------------------------------------------------------------


@ONE_ORDER
def test_count_tokens(client: anthropic.Anthropic, cluster: Cluster) -> None:
    short = client.messages.count_tokens(model=cluster.model, messages=ask("Hello"))
    longer = client.messages.count_tokens(model=cluster.model, messages=ask("Hello " + "more words here " * 20))
    with_tools = client.messages.count_tokens(model=cluster.model, messages=ask("Hello"), tools=[WEATHER_TOOL])
    assert short.input_tokens > 0
    assert longer.input_tokens > short.input_tokens
    assert with_tools.input_tokens > short.input_tokens
    # The count is the prompt the answer is billed for.
    message = client.messages.create(model=cluster.model, max_tokens=8, messages=ask("Hello"))
    assert message.usage.input_tokens == short.input_tokens


@ONE_ORDER
def test_models_list_and_retrieve(client: anthropic.Anthropic, cluster: Cluster) -> None:
    page = client.models.list()
    ids = [model.id for model in page]
    assert cluster.model in ids
    model = client.models.retrieve(cluster.model)
    assert model.id == cluster.model and model.type == "model" and model.display_name
    assert model.created_at.year >= 2024


@ONE_ORDER
def test_models_auto_pagination_over_pools(client: anthropic.Anthropic, cluster: Cluster) -> None:
    from workers.models import WorkerEndpoint, WorkerPool

    for model in ("aaa-model", "zzz-model"):
        pool = WorkerPool.objects.create(name=f"pool-{model}", model=model)
        WorkerEndpoint.objects.create(pool=pool, role="context", url=cluster.context.url)
        WorkerEndpoint.objects.create(pool=pool, role="generation", url=cluster.generation.url)
    wait_until(lambda: len(client.models.list().data) == 3, message="the gateway never listed the new pools")
    first = client.models.list(limit=1)
    assert [m.id for m in first.data] == ["aaa-model"] and first.has_more and first.last_id == "aaa-model"
    # The SDK pages on by `after_id` until has_more is false.
    assert [m.id for m in client.models.list(limit=1)] == ["aaa-model", cluster.model, "zzz-model"]


def test_beta_messages_with_unknown_betas(client: anthropic.Anthropic, cluster: Cluster) -> None:
    """Unknown `anthropic-beta` values are tolerated, on `/v1/messages?beta=true` as Claude Code posts.

    SDK 2.x no longer adds `?beta=true` to beta calls by itself (0.x did), so it is asked for here.
    """
    betas = ["some-unknown-beta-2099-01-01", "interleaved-thinking-2025-05-14"]
    beta: dict[str, Any] = {"betas": betas, "extra_query": {"beta": "true"}}
    raw = client.beta.messages.with_raw_response.create(
        model=cluster.model, max_tokens=32, messages=ask("beta [sim tokens=3]"), **beta
    )
    assert raw.http_request.url.path == "/v1/messages"
    assert raw.http_request.url.params.get("beta") == "true"
    assert raw.http_request.headers["anthropic-beta"] == ",".join(betas)
    message = raw.parse()
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 3
    assert [block.type for block in message.content] == ["text"]

    with client.beta.messages.stream(
        model=cluster.model, max_tokens=32, messages=ask("beta stream [sim tokens=3]"), **beta
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(streamed.split()) == 3 and final.stop_reason == "end_turn"

    # The SDK's own default path (no query string) works the same.
    plain = client.beta.messages.create(model=cluster.model, max_tokens=8, betas=betas, messages=ask("plain [sim tokens=2]"))
    assert plain.usage.output_tokens == 2

    counted = client.beta.messages.count_tokens(model=cluster.model, messages=ask("beta"), **beta)
    assert counted.input_tokens == client.messages.count_tokens(model=cluster.model, messages=ask("beta")).input_tokens > 0


@ONE_ORDER
def test_x_api_key_and_the_older_version_header(gateway: Gateway, cluster: Cluster) -> None:
    """The 0.x SDKs and Claude Code send `x-api-key` and `anthropic-version: 2023-06-01`."""
    with anthropic.Anthropic(
        base_url=gateway.url,
        auth_token="unused-placeholder",
        max_retries=0,
        default_headers={"Authorization": anthropic.Omit(), "X-Api-Key": cluster.key, "anthropic-version": "2023-06-01"},
    ) as client:
        raw = client.messages.with_raw_response.create(model=cluster.model, max_tokens=8, messages=ask("hi [sim tokens=2]"))
    assert "authorization" not in raw.http_request.headers
    assert raw.http_request.headers["x-api-key"] == cluster.key
    assert raw.http_request.headers["anthropic-version"] == "2023-06-01"
    assert raw.parse().usage.output_tokens == 2


@ONE_ORDER
def test_sdk_default_auth_is_bearer(client: anthropic.Anthropic, cluster: Cluster) -> None:
    raw = client.messages.with_raw_response.create(model=cluster.model, max_tokens=8, messages=ask("hi [sim tokens=1]"))
    assert raw.http_request.headers["authorization"] == f"Bearer {cluster.key}"
    assert "x-api-key" not in raw.http_request.headers
    assert raw.status_code == 200
