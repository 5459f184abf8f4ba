"""The stream reframer, the accumulator and SSE framing: pure, no I/O.

`assert_event_invariants` states the stream contract the SDKs rely on; every stream built here goes through it, and the complete ones
also go through the official SDK: its accumulator, its SSE decoder and its client.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import anthropic
import httpx2  # the SDK's HTTP client package (it refuses httpx objects)
import orjson
import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._messages import accumulate_event

from messages_api.accumulate import accumulate_message
from messages_api.errors import AnthropicError
from messages_api.framing import PING_FRAME, encode_event
from messages_api.reframe import CHARS_PER_TOKEN, LONG_PIECE_ALLOWANCE, OutputLimitReached, StreamReframer
from tests.support.sdk import sdk_client, sdk_message
from workers.protocols.base import completion_as_chunks

Event = dict[str, Any]

LEGAL_DELTAS = {
    "text": {"text_delta", "citations_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
    "tool_use": {"input_json_delta"},
}


def assert_event_invariants(events: list[Event]) -> None:
    """message_start first and once; blocks 0..n in order, never interleaved, with deltas that fit
    the block; then message_delta and message_stop last — or, after a failure, an error event last
    and no message_delta/message_stop at all."""
    events = [e for e in events if e["type"] != "ping"]
    types = [e["type"] for e in events]
    assert types, "no events"
    if types == ["error"]:
        return  # failed before the message started
    assert types[0] == "message_start", types
    assert types.count("message_start") == 1, types
    usage = events[0]["message"]["usage"]
    assert isinstance(usage["input_tokens"], int) and isinstance(usage["output_tokens"], int)
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    failed = "error" in types
    if failed:
        assert types[-1] == "error" and types.count("error") == 1, types
        assert "message_stop" not in types and "message_delta" not in types, types
    else:
        assert types[-2:] == ["message_delta", "message_stop"], types
        assert types.count("message_delta") == 1 and types.count("message_stop") == 1, types
        assert events[-2]["delta"]["stop_reason"] is not None
        assert isinstance(events[-2]["usage"]["output_tokens"], int)
    open_index: int | None = None
    open_kind: str | None = None
    next_index = 0
    for event in events[1:]:
        kind = event["type"]
        if kind == "content_block_start":
            assert open_index is None, f"block {event['index']} opened while {open_index} is open"
            assert event["index"] == next_index, f"index {event['index']}, expected {next_index}"
            open_index, open_kind = event["index"], event["content_block"]["type"]
            next_index += 1
        elif kind == "content_block_delta":
            assert event["index"] == open_index, f"delta for {event['index']} while {open_index} is open"
            assert event["delta"]["type"] in LEGAL_DELTAS[open_kind], (open_kind, event["delta"]["type"])  # type: ignore[index]
        elif kind == "content_block_stop":
            assert event["index"] == open_index, f"stop for {event['index']} while {open_index} is open"
            open_index = open_kind = None
        else:
            assert kind in ("message_delta", "message_stop", "error"), kind
            assert open_index is None, f"{kind} while block {open_index} is open"


# -- helpers ------------------------------------------------------------------------------------


def chunk(
    content: str | None = None,
    *,
    reasoning: str | None = None,
    reasoning_key: str = "reasoning_content",
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str | None = None,
    stop_reason: object = None,
    usage: dict[str, Any] | None = None,
    role: str | None = None,
) -> dict[str, Any]:
    """A chat.completion.chunk as vLLM / TRT-LLM send it."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta[reasoning_key] = reasoning
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "qwen3",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """The include_usage chunk after the last choice."""
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "qwen3", "choices": [], "usage": usage(prompt, completion, cached)}


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def anthropic_usage(input_tokens: int, output_tokens: int, *, cache_read: int = 0) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cache_read,
    }


def call(index: int | None, arguments: str | None = None, *, id: str | None = None, name: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if arguments is not None:
        function["arguments"] = arguments
    fragment: dict[str, Any] = {"type": "function", "function": function}
    if index is not None:
        fragment["index"] = index
    if id is not None:
        fragment["id"] = id
    return fragment


def reframer(**kwargs: Any) -> StreamReframer:
    return StreamReframer(message_id="msg_test", model="claude-sonnet-4-6", **kwargs)


def run(chunks: Iterable[dict[str, Any]], **kwargs: Any) -> list[Event]:
    r = reframer(**kwargs)
    events: list[Event] = []
    for c in chunks:
        events += r.feed(c)
    events += r.finish()
    assert_event_invariants(events)
    return events


def sdk_accumulate(events: list[Event]) -> anthropic.types.Message:
    """The Python SDK's own fold of the same events."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    return snapshot


def final_message(events: list[Event]) -> dict[str, Any]:
    """accumulate_message, checked against the SDK's Message type and the SDK's own fold."""
    message = accumulate_message(events)
    parsed = anthropic.types.Message.model_validate(message)
    sdk = sdk_accumulate(events)
    assert [block.model_dump() for block in parsed.content] == [block.model_dump() for block in sdk.content]
    assert (parsed.stop_reason, parsed.stop_sequence) == (sdk.stop_reason, sdk.stop_sequence)
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (sdk.usage.input_tokens, sdk.usage.output_tokens)
    return message


def kinds(events: list[Event]) -> list[str]:
    out = []
    for e in events:
        if e["type"] == "content_block_start":
            out.append(f"start:{e['content_block']['type']}")
        elif e["type"] == "content_block_delta":
            out.append(e["delta"]["type"])
        elif e["type"] == "content_block_stop":
            out.append("stop")
        else:
            out.append(e["type"])
    return out


# -- text ---------------------------------------------------------------------------------------


def test_text_stream() -> None:
    events = run(
        [chunk("", role="assistant"), chunk("Hello"), chunk(""), chunk(", world"), chunk(finish="stop"), usage_chunk(12, 3)],
        input_tokens=12,
    )
    assert kinds(events) == ["message_start", "start:text", "text_delta", "text_delta", "stop", "message_delta", "message_stop"]
    assert events[0]["message"] == {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-6",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": anthropic_usage(12, 0),
    }
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": anthropic_usage(12, 3),
    }
    message = final_message(events)
    assert message["content"] == [{"type": "text", "text": "Hello, world"}]
    assert message["usage"] == {"input_tokens": 12, "output_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def test_message_start_comes_with_the_first_chunk_whatever_it_holds() -> None:
    r = reframer()
    assert kinds(r.feed(chunk(role="assistant"))) == ["message_start"]
    assert r.started
    assert r.feed(chunk("")) == []
    assert kinds(r.feed(chunk("x"))) == ["start:text", "text_delta"]


def test_a_chunk_without_choices_or_delta_is_harmless() -> None:
    events = run([{"choices": []}, {"choices": [{"index": 0, "delta": {}}]}, {"choices": [{"index": 0}]}, chunk("a"), chunk(finish="stop")])
    assert final_message(events)["content"] == [{"type": "text", "text": "a"}]


# -- thinking -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reasoning_key", ["reasoning_content", "reasoning"])
def test_thinking_then_text(reasoning_key: str) -> None:
    events = run(
        [
            chunk(role="assistant", content=""),
            chunk(reasoning="Let me ", reasoning_key=reasoning_key),
            chunk(reasoning="think.", reasoning_key=reasoning_key),
            chunk("The answer"),
            chunk(" is 4."),
            chunk(finish="stop"),
        ]
    )
    assert kinds(events) == [
        "message_start",
        "start:thinking",
        "thinking_delta",
        "thinking_delta",
        "stop",
        "start:text",
        "text_delta",
        "text_delta",
        "stop",
        "message_delta",
        "message_stop",
    ]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert final_message(events)["content"] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "The answer is 4."},
    ]


def test_reasoning_sent_under_both_names_is_not_doubled() -> None:
    both = chunk(reasoning="once")
    both["choices"][0]["delta"]["reasoning"] = "once"
    events = run([both, chunk("a"), chunk(finish="stop")])
    assert final_message(events)["content"][0]["thinking"] == "once"


def test_reasoning_and_content_in_one_chunk_make_two_blocks_in_order() -> None:
    events = run([chunk("answer", reasoning="thought"), chunk(finish="stop")])
    assert [b["type"] for b in final_message(events)["content"]] == ["thinking", "text"]


# -- tool calls ---------------------------------------------------------------------------------


def test_one_tool_call_streams_its_arguments() -> None:
    events = run(
        [
            chunk("Let me check."),
            chunk(tool_calls=[call(0, "", id="chatcmpl-tool-9f2", name="get_weather")]),
            chunk(tool_calls=[call(0, '{"location": ')]),
            chunk(tool_calls=[call(0, '"Paris", "unit": "c"}')]),
            chunk(finish="tool_calls"),
        ]
    )
    assert kinds(events) == [
        "message_start",
        "start:text",
        "text_delta",
        "stop",
        "start:tool_use",
        "input_json_delta",
        "input_json_delta",
        "stop",
        "message_delta",
        "message_stop",
    ]
    assert events[4]["content_block"] == {"type": "tool_use", "id": "chatcmpl-tool-9f2", "name": "get_weather", "input": {}}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    message = final_message(events)
    assert message["content"][1] == {
        "type": "tool_use",
        "id": "chatcmpl-tool-9f2",
        "name": "get_weather",
        "input": {"location": "Paris", "unit": "c"},
    }
    assert message["stop_reason"] == "tool_use"


def test_tool_call_without_an_id_gets_a_toolu_id() -> None:
    events = run([chunk(tool_calls=[call(0, '{"a": 1}', name="f")]), chunk(finish="tool_calls")])
    tool_id = events[1]["content_block"]["id"]
    assert tool_id.startswith("toolu_") and len(tool_id) > len("toolu_") + 16


def test_tool_call_whose_name_comes_after_its_first_fragment() -> None:
    events = run(
        [
            chunk(tool_calls=[call(0, '{"q"', id="call_1")]),
            chunk(tool_calls=[call(0, ': "x"}', name="search")]),
            chunk(finish="tool_calls"),
        ]
    )
    assert kinds(events)[1:4] == ["start:tool_use", "input_json_delta", "input_json_delta"]
    assert final_message(events)["content"] == [{"type": "tool_use", "id": "call_1", "name": "search", "input": {"q": "x"}}]


def test_producer_repeating_id_and_name_on_every_fragment_makes_one_block() -> None:
    events = run(
        [
            chunk(tool_calls=[call(0, '{"a":', id="c1", name="f")]),
            chunk(tool_calls=[call(0, " 1}", id="c1", name="f")]),
            chunk(finish="tool_calls"),
        ]
    )
    assert final_message(events)["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]


def test_empty_arguments_mean_an_empty_input() -> None:
    events = run([chunk(tool_calls=[call(0, "", id="c1", name="now")]), chunk(finish="tool_calls")])
    assert [k for k in kinds(events) if k == "input_json_delta"] == []
    assert final_message(events)["content"][0]["input"] == {}


def test_two_interleaved_tool_calls_are_serialised() -> None:
    events = run(
        [
            chunk(tool_calls=[call(0, "", id="c0", name="read"), call(1, "", id="c1", name="grep")]),
            chunk(tool_calls=[call(0, '{"path": '), call(1, '{"pattern": ')]),
            chunk(tool_calls=[call(1, '"TODO"}')]),
            chunk(tool_calls=[call(0, '"a.py"}')]),
            chunk(finish="tool_calls"),
            usage_chunk(40, 22),
        ]
    )
    assert kinds(events) == [
        "message_start",
        "start:tool_use",
        "input_json_delta",
        "input_json_delta",
        "stop",
        "start:tool_use",
        "input_json_delta",
        "input_json_delta",
        "stop",
        "message_delta",
        "message_stop",
    ]
    assert final_message(events)["content"] == [
        {"type": "tool_use", "id": "c0", "name": "read", "input": {"path": "a.py"}},
        {"type": "tool_use", "id": "c1", "name": "grep", "input": {"pattern": "TODO"}},
    ]


def test_calls_streamed_one_after_another_each_stream_live() -> None:
    r = reframer()
    first = r.feed(chunk(tool_calls=[call(0, '{"x": 1}', id="c0", name="a")]))
    second = r.feed(chunk(tool_calls=[call(1, '{"y"', id="c1", name="b")]))
    # the first call's JSON is complete, so the second takes the block at once
    assert kinds(second) == ["stop", "start:tool_use", "input_json_delta"]
    third = r.feed(chunk(tool_calls=[call(1, ": 2}")]))
    assert kinds(third) == ["input_json_delta"]
    events = first + second + third + r.feed(chunk(finish="tool_calls")) + r.finish()
    assert_event_invariants(events)
    assert [b["input"] for b in final_message(events)["content"]] == [{"x": 1}, {"y": 2}]


def test_three_calls_with_random_interleaving_keep_every_fragment() -> None:
    inputs = [{"path": "src/app.py", "limit": 200}, {"pattern": "def \\w+\\(", "glob": "**/*.py"}, {"command": "ls -la", "timeout": 30}]
    names = ["Read", "Grep", "Bash"]
    rng = random.Random(1234)
    for _ in range(50):
        streams: list[list[dict[str, Any]]] = []
        for i, value in enumerate(inputs):
            text = orjson.dumps(value).decode()
            cuts = sorted(rng.sample(range(1, len(text)), 4))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            streams.append([call(i, "", id=f"c{i}", name=names[i])] + [call(i, p) for p in pieces])
        chunks = []
        while any(streams):
            stream = rng.choice([s for s in streams if s])
            chunks.append(chunk(tool_calls=[stream.pop(0)]))
        events = run([*chunks, chunk(finish="tool_calls")])
        content = final_message(events)["content"]
        assert sorted((b["name"], orjson.dumps(b["input"])) for b in content) == sorted(
            (n, orjson.dumps(v)) for n, v in zip(names, inputs, strict=True)
        )


def test_text_after_a_tool_call_closes_it_and_flushes_buffered_calls() -> None:
    events = run(
        [
            chunk(tool_calls=[call(0, '{"a": ', id="c0", name="f"), call(1, '{"b": 2}', id="c1", name="g")]),
            chunk(tool_calls=[call(0, "1}")]),
            chunk("Done."),
            chunk(finish="stop"),
        ]
    )
    assert [b["type"] for b in final_message(events)["content"]] == ["tool_use", "tool_use", "text"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_fragments_without_an_index_follow_the_open_call() -> None:
    events = run(
        [
            chunk(tool_calls=[call(None, "", id="c0", name="f")]),
            chunk(tool_calls=[call(None, '{"a": 1}')]),
            chunk(tool_calls=[call(None, "", id="c1", name="g")]),
            chunk(tool_calls=[call(None, "{}")]),
            chunk(finish="tool_calls"),
        ]
    )
    assert [(b["name"], b["input"]) for b in final_message(events)["content"]] == [("f", {"a": 1}), ("g", {})]


# -- invalid tool arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("arguments", ['{"a": 1', "[1, 2]", '"text"', "null", "not json", '{"a": 1}}'])
def test_invalid_arguments_raise_at_finish_and_fail_closes_the_block(arguments: str) -> None:
    r = reframer()
    events = r.feed(chunk(tool_calls=[call(0, "", id="c0", name="f")]))
    events += r.feed(chunk(tool_calls=[call(0, arguments)]))
    events += r.feed(chunk(finish="tool_calls"))
    with pytest.raises(AnthropicError) as info:
        r.finish()
    assert (info.value.status, info.value.error_type) == (500, "api_error")
    assert info.value.message == "The worker returned tool call arguments that are not a JSON object"
    events += r.fail(info.value.event())
    assert kinds(events)[-2:] == ["stop", "error"]
    assert_event_invariants(events)
    with pytest.raises(AnthropicError):
        accumulate_message(events)


def test_invalid_arguments_found_when_text_closes_the_block_keep_the_events_of_that_chunk() -> None:
    r = reframer()
    events = r.feed(chunk(tool_calls=[call(0, '{"a": ', id="c0", name="f")]))
    with pytest.raises(AnthropicError):
        r.feed(chunk("oops"))
    events += r.fail({"type": "error", "error": {"type": "api_error", "message": "bad"}})
    assert kinds(events) == ["message_start", "start:tool_use", "input_json_delta", "stop", "error"]
    assert_event_invariants(events)


def test_failure_inside_the_first_chunk_still_delivers_message_start() -> None:
    r = reframer()
    with pytest.raises(AnthropicError):
        r.feed(chunk(finish="abort"))
    assert r.started
    events = r.fail({"type": "error", "error": {"type": "api_error", "message": "x"}})
    assert kinds(events) == ["message_start", "error"]
    assert_event_invariants(events)


def test_a_closed_call_that_continues_is_an_error() -> None:
    r = reframer()
    r.feed(chunk(tool_calls=[call(0, '{"a": 1}', id="c0", name="f")]))
    r.feed(chunk(tool_calls=[call(1, "{}", id="c1", name="g")]))  # closes call 0
    r.feed(chunk(tool_calls=[call(0, "  ")]))  # whitespace is still valid JSON
    with pytest.raises(AnthropicError):
        r.feed(chunk(tool_calls=[call(0, ', "b": 2}')]))


def test_a_call_that_never_got_a_name_is_an_error() -> None:
    r = reframer()
    r.feed(chunk(tool_calls=[call(0, '{"a": 1}', id="c0")]))
    with pytest.raises(AnthropicError) as info:
        r.finish()
    assert info.value.status == 500 and "without a name" in info.value.message


# -- stop reasons -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish", "stop_reason", "stop_sequences", "expected"),
    [
        ("stop", None, None, ("end_turn", None)),
        ("stop", "END", ["END", "###"], ("stop_sequence", "END")),
        ("stop", "###", ["END", "###"], ("stop_sequence", "###")),
        ("stop", "</s>", ["END"], ("end_turn", None)),  # a server-side stop string, not the client's
        ("stop", "END", None, ("end_turn", None)),
        ("stop", 151645, ["END"], ("end_turn", None)),  # a stop token id
        ("length", None, None, ("max_tokens", None)),
        ("tool_calls", None, None, ("tool_use", None)),
        ("function_call", None, None, ("tool_use", None)),
        ("content_filter", None, None, ("refusal", None)),
        (None, None, None, ("end_turn", None)),  # a stream that ends without saying why
    ],
)
def test_stop_reason_mapping(finish: str | None, stop_reason: object, stop_sequences: list[str] | None, expected: tuple[str, str | None]) -> None:
    events = run([chunk("x"), chunk(finish=finish, stop_reason=stop_reason)], stop_sequences=stop_sequences)
    assert (events[-2]["delta"]["stop_reason"], events[-2]["delta"]["stop_sequence"]) == expected
    message = final_message(events)
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_sglang_matched_stop_names_the_stop_sequence() -> None:
    c = chunk(finish="stop")
    c["choices"][0]["matched_stop"] = "STOP"
    del c["choices"][0]["stop_reason"]
    events = run([chunk("x"), c], stop_sequences=["STOP"])
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


@pytest.mark.parametrize(("finish", "expected"), [("stop", "tool_use"), ("length", "max_tokens"), (None, "tool_use")])
def test_a_turn_with_tool_use_ends_in_tool_use_unless_truncated(finish: str | None, expected: str) -> None:
    events = run([chunk(tool_calls=[call(0, "{}", id="c", name="f")]), chunk(finish=finish, stop_reason="END")], stop_sequences=["END"])
    assert events[-2]["delta"] == {"stop_reason": expected, "stop_sequence": None}


@pytest.mark.parametrize(("finish", "expected"), [("stop", "tool_use"), ("content_filter", "refusal")])
def test_a_filtered_turn_with_tool_use_is_a_refusal_not_a_tool_turn(finish: str, expected: str) -> None:
    # A client runs the tools of a tool_use turn; a turn the filter cut must not run them.
    events = run([chunk(tool_calls=[call(0, "{}", id="c", name="f")]), chunk(finish=finish)])
    assert events[-2]["delta"]["stop_reason"] == expected


def test_tool_arguments_cut_by_a_content_filter_are_a_truncated_block() -> None:
    events = run([chunk(tool_calls=[call(0, '{"path": "/etc", "li', id="c", name="read")]), chunk(finish="content_filter")])
    assert events[-2]["delta"]["stop_reason"] == "refusal"
    message = final_message(events)
    assert message["content"] == [{"type": "tool_use", "id": "c", "name": "read", "input": {"path": "/etc"}}]


# Every reason an engine gives for giving up (TensorRT-LLM: timeout, cancelled; vLLM: abort,
# error, repetition; SGLang: abort; TensorRT-LLM's context phase: not_finished), and one no
# engine documents: never a success stop_reason.
GIVE_UPS = [
    ("timeout", 504, "timeout_error"),
    ("cancelled", 500, "api_error"),
    ("abort", 500, "api_error"),
    ("error", 500, "api_error"),
    ("repetition", 500, "api_error"),
    ("not_finished", 502, "api_error"),
    ("eos_reached_v2", 502, "api_error"),
]


@pytest.mark.parametrize(("finish", "status", "error_type"), GIVE_UPS)
def test_a_worker_giving_up_is_a_failure_not_an_end_turn(finish: str, status: int, error_type: str) -> None:
    r = reframer()
    events = r.feed(chunk("partial"))
    with pytest.raises(AnthropicError) as info:
        r.feed(chunk(finish=finish))
    assert (info.value.status, info.value.error_type) == (status, error_type)
    assert "eos_reached_v2" not in info.value.message  # worker data: never shown to the client
    events += r.fail(info.value.event())
    assert kinds(events)[-2:] == ["stop", "error"]
    assert_event_invariants(events)


@pytest.mark.parametrize(("finish", "status", "error_type"), GIVE_UPS)
def test_a_worker_giving_up_non_streamed_is_the_same_error(finish: str, status: int, error_type: str) -> None:
    """The non-streamed path (a complete context answer, or `respond_json` over a stream) feeds the
    same reframer: the reason is the HTTP error, with the streamed error's type and message."""
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "qwen3",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "partial"}, "finish_reason": finish}],
        "usage": usage(12, 3),
    }
    streamed = reframer()
    with pytest.raises(AnthropicError) as streamed_error:
        streamed.feed(chunk("partial"))
        streamed.feed(chunk(finish=finish))
    r = reframer()
    with pytest.raises(AnthropicError) as info:
        accumulate_message([event for c in completion_as_chunks(completion) for event in r.feed(c)] + r.finish())
    assert (info.value.status, info.value.error_type, info.value.message) == (
        status,
        error_type,
        streamed_error.value.message,
    )


def test_an_unknown_finish_reason_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    r = reframer()
    with caplog.at_level("WARNING", logger="messages_api.reframe"), pytest.raises(AnthropicError):
        r.feed(chunk("x", finish="eos_reached_v2"))
    assert "eos_reached_v2" in caplog.text


def test_a_content_filtered_answer_non_streamed_is_a_refusal() -> None:
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "qwen3",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "I can"}, "finish_reason": "content_filter"}],
    }
    r = reframer()
    events = [event for c in completion_as_chunks(completion) for event in r.feed(c)] + r.finish()
    message = final_message(events)
    assert (message["stop_reason"], message["content"]) == ("refusal", [{"type": "text", "text": "I can"}])


# -- usage --------------------------------------------------------------------------------------


def test_continuous_usage_with_cached_tokens() -> None:
    chunks = [
        chunk("", role="assistant", usage=usage(1000, 0, cached=640)),
        chunk("a", usage=usage(1000, 1, cached=640)),
        chunk("b", usage=usage(1000, 2, cached=640)),
        chunk(finish="stop", usage=usage(1000, 2, cached=640)),
        usage_chunk(1000, 2, cached=640),
    ]
    events = run(chunks, input_tokens=999)
    assert events[0]["message"]["usage"] == anthropic_usage(360, 0, cache_read=640)
    assert events[-2]["usage"] == anthropic_usage(360, 2, cache_read=640)
    message = final_message(events)
    assert message["usage"] == {"input_tokens": 360, "output_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 640}


def test_usage_only_at_the_end_keeps_the_given_input_tokens_in_message_start() -> None:
    r = reframer(input_tokens=77)
    events = r.feed(chunk("hi"))
    assert events[0]["message"]["usage"] == anthropic_usage(77, 0)
    assert (r.input_tokens, r.output_tokens) == (77, 1)  # the worker reported none yet: what was relayed
    events += r.feed(chunk(finish="stop"))
    events += r.feed(usage_chunk(80, 5, cached=0))
    assert (r.input_tokens, r.output_tokens) == (80, 5)
    events += r.finish()
    assert events[-2]["usage"] == anthropic_usage(80, 5)


def test_no_usage_at_all() -> None:
    events = run([chunk("hi"), chunk(finish="stop")])
    assert events[0]["message"]["usage"] == anthropic_usage(0, 0)
    # Output tokens the worker never reported are counted from what was relayed, never 0.
    assert events[-2]["usage"] == anthropic_usage(0, 1)


def test_cached_tokens_above_prompt_tokens_do_not_go_negative() -> None:
    events = run([chunk("x", usage=usage(10, 1, cached=12)), chunk(finish="stop")])
    # A worker reporting more cached tokens than its prompt: the read is the prompt, so that input,
    # creation and read still add up to it (messages_api/cache_accounting.py).
    assert events[0]["message"]["usage"] == anthropic_usage(0, 0, cache_read=10)


# -- empty streams, finish and fail -------------------------------------------------------------


def test_finish_without_any_chunk_is_an_empty_message() -> None:
    r = reframer(input_tokens=5)
    events = r.finish()
    assert kinds(events) == ["message_start", "message_delta", "message_stop"]
    assert events[1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert_event_invariants(events)
    message = final_message(events)
    assert message["content"] == []
    assert r.finish() == []


def test_stream_with_only_empty_deltas_has_no_blocks() -> None:
    events = run([chunk("", role="assistant"), chunk(""), chunk(finish="stop"), usage_chunk(9, 1)])
    assert kinds(events) == ["message_start", "message_delta", "message_stop"]
    assert final_message(events)["content"] == []


def test_fail_before_start_is_only_the_error() -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    r = reframer()
    assert r.fail(error) == [error]
    assert not r.started
    assert r.finish() == []


def test_fail_after_start_closes_the_open_block() -> None:
    error = {"type": "error", "error": {"type": "api_error", "message": "Upstream stream ended before [DONE]"}}
    r = reframer()
    events = r.feed(chunk("partial"))
    events += r.fail(error)
    assert kinds(events) == ["message_start", "start:text", "text_delta", "stop", "error"]
    assert_event_invariants(events)
    assert r.fail(error) == [] and r.finish() == []


def test_fail_between_blocks_adds_no_stop() -> None:
    r = reframer()
    events = r.feed(chunk(role="assistant"))
    events += r.fail({"type": "error", "error": {"type": "timeout_error", "message": "t"}})
    assert kinds(events) == ["message_start", "error"]


def test_fail_after_finish_adds_nothing() -> None:
    r = reframer()
    r.feed(chunk("x"))
    r.finish()
    assert r.fail({"type": "error", "error": {"type": "api_error", "message": "late"}}) == []


# -- accumulate_message -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error_type", "status"),
    [
        ("api_error", 500),
        ("overloaded_error", 529),
        ("invalid_request_error", 400),
        ("timeout_error", 504),
        ("rate_limit_error", 429),
        ("not_found_error", 404),
        ("request_too_large", 413),
        ("something_else", 500),
    ],
)
def test_an_error_event_is_raised_with_its_status(error_type: str, status: int) -> None:
    r = reframer()
    events = r.feed(chunk("partial")) + r.fail({"type": "error", "error": {"type": error_type, "message": "went wrong"}})
    with pytest.raises(AnthropicError) as info:
        accumulate_message(events)
    assert (info.value.status, info.value.error_type, info.value.message) == (status, error_type, "went wrong")


def test_error_before_start_is_raised_too() -> None:
    with pytest.raises(AnthropicError) as info:
        accumulate_message([{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}])
    assert info.value.status == 529


@pytest.mark.parametrize(
    "events",
    [
        [],
        [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}],
        [{"type": "message_start", "message": {"id": "m", "model": "x", "usage": {"input_tokens": 1, "output_tokens": 0}}}],
    ],
)
def test_incomplete_or_out_of_order_streams_are_errors(events: list[Event]) -> None:
    with pytest.raises(AnthropicError) as info:
        accumulate_message(events)
    assert info.value.status == 500


def test_pings_are_ignored() -> None:
    events = run([chunk("x"), chunk(finish="stop")])
    with_pings = [events[0], {"type": "ping"}, *events[1:-1], {"type": "ping"}, events[-1]]
    assert accumulate_message(with_pings) == accumulate_message(events)


def test_full_message_shape() -> None:
    events = run(
        [
            chunk(reasoning="plan", usage=usage(50, 1, cached=20)),
            chunk("I'll call it.", usage=usage(50, 2, cached=20)),
            chunk(tool_calls=[call(0, '{"n": 3}', id="call_7", name="count")], usage=usage(50, 3, cached=20)),
            chunk(finish="tool_calls", usage=usage(50, 3, cached=20)),
        ]
    )
    assert final_message(events) == {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-6",
        "content": [
            {"type": "thinking", "thinking": "plan", "signature": ""},
            {"type": "text", "text": "I'll call it."},
            {"type": "tool_use", "id": "call_7", "name": "count", "input": {"n": 3}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 30, "output_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 20},
    }


# -- SSE framing and the official SDK end to end ------------------------------------------------


def test_encode_event_and_ping_frame() -> None:
    assert encode_event({"type": "message_stop"}) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert encode_event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a\nb \u00e9\U0001f30d"}}) == (
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"a\\nb \u00e9\U0001f30d"}}\n\n'
    ).encode()
    assert PING_FRAME == b'event: ping\ndata: {"type": "ping"}\n\n'


def sse_bytes(events: list[Event], *, pings: bool = True) -> bytes:
    frames = [encode_event(e) for e in events]
    if pings:
        frames.insert(1, PING_FRAME)
        frames.insert(0, PING_FRAME)
    return b"".join(frames)


def split_randomly(data: bytes, rng: random.Random) -> Iterator[bytes]:
    i = 0
    while i < len(data):
        n = rng.randint(1, 40)
        yield data[i : i + n]
        i += n


def sample_events() -> list[Event]:
    return run(
        [
            chunk(reasoning="Think\u00e9", usage=usage(30, 1)),
            chunk("Hello \U0001f30d\n", usage=usage(30, 2)),
            chunk(tool_calls=[call(0, '{"city": "K\u00f8benhavn"}', id="call_1", name="weather")], usage=usage(30, 3)),
            chunk(finish="tool_calls", usage=usage(30, 3)),
        ]
    )


def test_sdk_sse_decoder_reads_our_frames_split_anywhere() -> None:
    events = sample_events()
    data = sse_bytes(events)
    rng = random.Random(7)
    for _ in range(20):
        decoded = [sse for sse in SSEDecoder().iter_bytes(split_randomly(data, rng))]
        named = [(sse.event, sse.json()) for sse in decoded if sse.event != "ping"]
        assert named == [(e["type"], e) for e in events]


def mock_client(handler: Any) -> anthropic.Anthropic:
    return sdk_client("http://gateway.test", "k", http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


REQUEST = {"model": "claude-sonnet-4-6", "max_tokens": 256, "messages": [{"role": "user", "content": "hi"}]}


def test_sdk_stream_and_create_agree_with_accumulate_message() -> None:
    events = sample_events()
    body = accumulate_message(events)

    def handler(request: httpx2.Request) -> httpx2.Response:
        if orjson.loads(request.content).get("stream"):
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=sse_bytes(events))
        return httpx2.Response(200, headers={"content-type": "application/json"}, content=orjson.dumps(body))

    client = mock_client(handler)
    streamed = sdk_message(client, True, **REQUEST)
    created = sdk_message(client, False, **REQUEST)
    assert streamed.model_dump() == created.model_dump()
    assert created.content[2].type == "tool_use" and created.content[2].input == {"city": "K\u00f8benhavn"}  # type: ignore[union-attr]
    assert created.stop_reason == "tool_use"


def test_sdk_raises_on_a_mid_stream_error_event() -> None:
    r = reframer()
    events = r.feed(chunk("partial")) + r.fail(AnthropicError(529, "Overloaded").event())

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=sse_bytes(events))

    with pytest.raises(anthropic.APIStatusError) as info:
        sdk_message(mock_client(handler), True, **REQUEST)
    assert "overloaded_error" in str(info.value)


# -- the hot path's steady state (its cost is measured by bench/reframe_cost.py) ---------------------


def test_a_repeated_text_chunk_is_one_text_delta_each_time() -> None:
    """The chunk bench/reframe_cost.py times: once the block is open, each further text chunk with
    continuous usage is exactly one text_delta, and encodes to one SSE frame."""
    r = reframer()
    text_chunk = chunk(" token", usage=usage(1000, 5))
    r.feed(text_chunk)
    for _ in range(3):
        events = r.feed(text_chunk)
        assert events == [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " token"}}]
        assert encode_event(events[0]).startswith(b"event: content_block_delta\ndata: ")


# -- max_tokens, enforced: what is relayed is counted, and stops at the limit ---------------------


def feed_until_the_limit(r: StreamReframer, chunks: Iterable[dict[str, Any]]) -> tuple[list[Event], int]:
    """Feed as the consumer does until the reframer stops the relay; then finish. Returns the
    events and how many chunks were fed whole."""
    events: list[Event] = []
    fed = 0
    for c in chunks:
        try:
            events += r.feed(c)
        except OutputLimitReached:
            break
        fed += 1
    events += r.finish()
    assert_event_invariants(events)
    return events, fed


def test_each_piece_counts_a_token_and_long_pieces_their_characters_past_the_allowance() -> None:
    r = reframer()
    pieces = [
        (chunk(reasoning="y" * 40), 1),  # one long token: not taken for several
        (chunk("a"), 2),
        (chunk("x" * CHARS_PER_TOKEN), 3),
        (chunk("x" * (CHARS_PER_TOKEN + 1)), 4),
        (chunk(tool_calls=[call(0, "", id="call_1", name="f")]), 5),  # a call's name
        (chunk(tool_calls=[call(0, '{"q": "' + "z" * 30 + '"}')]), 6),  # 38 characters
        (chunk(tool_calls=[call(0, "")]), 6),  # nothing
        (chunk(""), 6),
        # 40 + 17 + 38 + 400 characters of long pieces: past the allowance, 239 of them count.
        (chunk("w" * 400), -(-(40 + 17 + 38 + 400 - LONG_PIECE_ALLOWANCE) // CHARS_PER_TOKEN)),
        (chunk("b"), 15),  # a piece more, under the characters' count
        (chunk(finish="stop"), 15),
    ]
    for c, expected in pieces:
        r.feed(c)
        assert r.relayed_tokens == expected, c
    assert r.output_tokens == 15  # the worker reported none
    assert r.finish()[-2]["usage"]["output_tokens"] == 15


def test_the_workers_count_wins_when_it_is_larger() -> None:
    r = reframer()
    for text in ("a", "b", "c"):
        r.feed(chunk(text, usage=usage(10, 50)))
    assert (r.relayed_tokens, r.output_tokens) == (3, 50)
    r = reframer()
    for text in ("a", "b", "c"):
        r.feed(chunk(text, usage=usage(10, 1)))  # too few for what came: not taken at its word
    assert (r.relayed_tokens, r.output_tokens) == (3, 3)


def test_output_tokens_never_exceed_max_tokens_whatever_the_worker_reports() -> None:
    # A worker that ignored max_tokens but whose text fit the count (few, dense chunks).
    r = reframer(max_tokens=4)
    for text in ("one two three ", "four five six "):
        r.feed(chunk(text, usage=usage(10, 40)))
    events = r.feed(chunk(finish="stop", usage=usage(10, 40))) + r.finish()
    assert r.relayed_tokens == 2 and r.output_tokens == 4
    assert events[-2]["usage"]["output_tokens"] == 4


def test_a_worker_that_honours_max_tokens_is_not_cut() -> None:
    # Its last token brings the count to the limit; its finish and usage still come through.
    chunks = [chunk("a"), chunk("b"), chunk("c", finish="length"), usage_chunk(20, 3, cached=8)]
    events, fed = feed_until_the_limit(reframer(max_tokens=3), chunks)
    assert fed == len(chunks)
    message = final_message(events)
    assert message["content"] == [{"type": "text", "text": "abc"}] and message["stop_reason"] == "max_tokens"
    assert message["usage"] == anthropic_usage(12, 3, cache_read=8)


def test_a_piece_past_max_tokens_ends_the_message_at_the_limit() -> None:
    r = reframer(max_tokens=3, input_tokens=9)
    events, fed = feed_until_the_limit(r, [chunk("a"), chunk("b"), chunk("c"), chunk("d"), chunk("e")])
    assert fed == 3
    assert kinds(events)[-4:] == ["text_delta", "stop", "message_delta", "message_stop"]
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == anthropic_usage(9, 3)
    message = final_message(events)
    assert message["content"] == [{"type": "text", "text": "abc"}] and message["stop_reason"] == "max_tokens"
    assert r.finish() == [] and r.text_frame(chunk("f")) is None  # over


def test_the_text_fast_path_stops_at_the_limit_too() -> None:
    r = reframer(max_tokens=2)
    r.feed(chunk("a"))  # message_start, the block, the first token
    assert r.text_frame(chunk("b")) is not None
    assert r.text_frame(chunk("c")) is None  # at the limit: feed decides, and stops the relay
    with pytest.raises(OutputLimitReached):
        r.feed(chunk("c"))
    assert kinds(r.finish()) == ["stop", "message_delta", "message_stop"]
    assert r.output_tokens == 2


def test_the_events_of_the_chunk_the_limit_cut_come_before_the_end() -> None:
    # Its thinking piece fits (and closes the text block, opens a thinking one); its text does not.
    events, fed = feed_until_the_limit(reframer(max_tokens=2), [chunk("a"), chunk("b", reasoning="r"), chunk("c")])
    assert fed == 1
    assert kinds(events) == [
        "message_start", "start:text", "text_delta", "stop", "start:thinking", "thinking_delta", "stop", "message_delta", "message_stop",
    ]
    message = final_message(events)
    assert [block["type"] for block in message["content"]] == ["text", "thinking"] and message["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("max_tokens", [1, 64, 1000])
@pytest.mark.parametrize("frame", [1000, 100_000])
def test_a_frame_past_the_limit_is_cut_within_itself(max_tokens: int, frame: int) -> None:
    # The probe's worker: frames of `frame` characters, whatever max_tokens says. Before, the frame
    # that crossed the limit went whole: 1 → 63, 64 → 126, 1000 → 1008 tokens with 1000 characters.
    piece = ("tok " * frame)[:frame]
    r = reframer(max_tokens=max_tokens)
    events, fed = feed_until_the_limit(r, [chunk("a")] + [chunk(piece)] * 200)
    text = final_message(events)["content"][0]["text"]
    allowed = max_tokens * CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE
    if max_tokens == 1:
        assert fed == 1 and text == "a"  # the limit reached by the first piece: nothing more
    else:
        assert text == "a" + (piece * 200)[:allowed]  # the last frame cut where the count reaches the limit
        assert fed == allowed // frame + 1
    assert r.relayed_tokens == r.output_tokens == max_tokens
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == max_tokens


def test_a_first_frame_past_the_limit_is_cut_to_what_one_token_allows() -> None:
    huge = "x" * 8_000_000
    r = reframer(max_tokens=1)
    events, fed = feed_until_the_limit(r, [chunk(huge), chunk("more")])
    assert fed == 0
    assert final_message(events)["content"] == [{"type": "text", "text": huge[: CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE]}]
    assert r.output_tokens == 1 and events[-2]["delta"]["stop_reason"] == "max_tokens"


def test_a_thinking_frame_past_the_limit_is_cut_too() -> None:
    r = reframer(max_tokens=2)
    events, fed = feed_until_the_limit(r, [chunk(reasoning="r" * 10_000), chunk("answer")])
    assert fed == 0
    message = final_message(events)
    assert message["content"][0]["thinking"] == "r" * (2 * CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE)
    assert len(message["content"]) == 1 and message["stop_reason"] == "max_tokens" and r.output_tokens == 2


def test_a_frame_that_fills_the_count_exactly_is_relayed_and_the_next_piece_is_not() -> None:
    allowed = 3 * CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE
    r = reframer(max_tokens=3)
    events, fed = feed_until_the_limit(r, [chunk("x" * allowed), chunk("y")])
    assert fed == 1
    assert final_message(events)["content"] == [{"type": "text", "text": "x" * allowed}]
    assert r.output_tokens == 3 and r.text_frame(chunk("z")) is None


def test_a_correct_worker_with_long_tokens_is_not_cut() -> None:
    # One token of 40 spaces is all max_tokens 1 allows: it is one token, not three.
    events, fed = feed_until_the_limit(reframer(max_tokens=1), [chunk(" " * 40, finish="length"), usage_chunk(5, 1)])
    assert fed == 2
    message = final_message(events)
    assert message["content"] == [{"type": "text", "text": " " * 40}] and message["usage"]["output_tokens"] == 1
    # Code: indentation runs of 64 characters between short tokens, max_tokens of them exactly.
    tokens = ["\n" + " " * 63 if i % 4 == 0 else "x = 1" for i in range(40)]
    chunks = [chunk(t) for t in tokens[:-1]] + [chunk(tokens[-1], finish="length"), usage_chunk(5, 40)]
    events, fed = feed_until_the_limit(reframer(max_tokens=40), chunks)
    assert fed == len(chunks)
    assert final_message(events)["content"] == [{"type": "text", "text": "".join(tokens)}]
    assert events[-2]["usage"]["output_tokens"] == 40


def test_a_correct_engine_sending_several_tokens_per_chunk_is_not_cut() -> None:
    # vLLM merges the outputs a busy client has not taken yet: chunks of a few tokens each.
    words = [f" word{i % 10}" for i in range(256)]  # 6 characters a token
    chunks = [chunk("".join(words[i : i + 8])) for i in range(0, 256, 8)] + [chunk(finish="length", usage=usage(9, 256))]
    r = reframer(max_tokens=256)
    events, fed = feed_until_the_limit(r, chunks)
    assert fed == len(chunks) and r.output_tokens == 256
    assert final_message(events)["content"] == [{"type": "text", "text": "".join(words)}]


def test_a_random_worker_ignoring_max_tokens_never_gets_past_it() -> None:
    rng = random.Random(42)
    for _ in range(60):
        max_tokens = rng.choice([1, 2, 3, 7, 64, 500])
        sizes = [1, 4, 16, 17, 40, 300, 5000]
        chunks = [
            chunk("t" * rng.choice(sizes)) if rng.random() < 0.7 else chunk(reasoning="r" * rng.choice(sizes))
            for _ in range(rng.randrange(0, 400))
        ]
        # Then a tool call whose arguments never end: always past the limit.
        chunks.append(chunk(tool_calls=[call(0, '{"q": "', id="call_1", name="f")]))
        chunks += [chunk(tool_calls=[call(0, "a" * rng.choice(sizes))]) for _ in range(600)]
        r = reframer(max_tokens=max_tokens)
        events, _ = feed_until_the_limit(r, chunks)
        message = final_message(events)
        assert r.relayed_tokens <= max_tokens and message["usage"]["output_tokens"] <= max_tokens
        characters = sum(len(b.get("text", b.get("thinking", ""))) for b in message["content"])
        characters += sum(
            len(e["delta"]["partial_json"]) for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
        )
        assert characters <= 2 * max_tokens * CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE


def test_a_tool_call_cut_by_the_limit_is_a_truncated_tool_use() -> None:
    chunks = [
        chunk(tool_calls=[call(0, "", id="call_1", name="get_weather")]),
        chunk(tool_calls=[call(0, '{"city": ')]),
        chunk(tool_calls=[call(0, '"Paris"}')]),
    ]
    events, fed = feed_until_the_limit(reframer(max_tokens=2), chunks)
    assert fed == 2
    message = final_message(events)
    # Incomplete arguments are not an error here: the answer was cut, and says so (no client runs
    # a tool on stop_reason max_tokens).
    assert message["stop_reason"] == "max_tokens" and message["content"][0]["type"] == "tool_use"


def test_a_flood_of_new_tool_calls_stops_at_the_limit() -> None:
    r = reframer(max_tokens=5)
    flood = (chunk(tool_calls=[call(i, "", id=f"call_{i}", name="f")]) for i in range(10_000))
    events, fed = feed_until_the_limit(r, flood)
    assert fed == 5
    assert sum(1 for e in events if e["type"] == "content_block_start") == 5
    assert final_message(events)["stop_reason"] == "max_tokens"


def test_the_limit_holds_for_a_complete_answer_from_the_context_phase() -> None:
    # A context worker that answered the whole request: one chunk with everything in it.
    response = {
        "choices": [{"message": {"content": "x" * 40, "reasoning_content": "r" * 40}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    events, fed = feed_until_the_limit(reframer(max_tokens=1), completion_as_chunks(response))
    assert fed == 0  # the thinking fits (it brings the count to the limit), the text does not
    message = final_message(events)
    assert [block["type"] for block in message["content"]] == ["thinking"] and message["stop_reason"] == "max_tokens"
