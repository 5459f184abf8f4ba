"""workers.wire.shapes: worker answers checked against the documented OpenAI chat shapes."""

from __future__ import annotations

from typing import Any

import pytest

from workers.wire.shapes import ShapeError, check_chunk, check_completion


def chunk(delta: Any = None, finish_reason: Any = None, **choice: Any) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **choice}]}


def completion(message: Any, **extra: Any) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], **extra}


TOOL_CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a":'}}

VALID_CHUNKS = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "hi", "reasoning_content": None}),
    chunk({"reasoning": "thinking"}),
    chunk({"tool_calls": [TOOL_CALL]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),  # a later delta of a call
    chunk({"tool_calls": [{"index": 1, "id": None, "type": None, "function": {"name": None, "arguments": None}}]}),
    chunk({}, "stop", stop_reason=None),
    chunk(None, "length"),  # the last chunk may carry only the finish reason
    {"choices": [{"index": 0, "finish_reason": "stop", "matched_stop": 2}]},  # SGLang
    # vLLM's and TensorRT-LLM's extra fields pass through.
    {**chunk({"content": "x"}, token_ids=[1, 2]), "prompt_token_ids": [3], "kv_transfer_params": {"a": 1}},
    chunk({"content": "x"}, disaggregated_params={"ctx_request_id": 1}, stop_reason=7),
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
                              "prompt_tokens_details": {"cached_tokens": 2}}},
    {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": None, "completion_tokens_details": {"reasoning_tokens": 1}}},
    {"usage": None},
]


@pytest.mark.parametrize("value", VALID_CHUNKS)
def test_documented_chunks_pass_unchanged(value: dict[str, Any]) -> None:
    assert check_chunk(value) is value


# The malformed chunks issue 9 found (and a few of their kin), with the field each must name.
MALFORMED_CHUNKS = [
    ({"choices": [None]}, "choices[0] is not an object"),
    ([1, 2, 3], "the chunk is not an object"),
    ({"choices": "abc"}, "choices is not a list"),
    (5, "the chunk is not an object"),
    ({"usage": 5}, "usage is not an object"),
    ({"usage": {"prompt_tokens": "many"}}, "usage.prompt_tokens is not a non-negative integer"),
    ({"usage": {"completion_tokens": -1}}, "usage.completion_tokens is not a non-negative integer"),
    ({"usage": {"total_tokens": True}}, "usage.total_tokens is not a non-negative integer"),
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 1.5}}}, "usage.prompt_tokens_details.cached_tokens is not a non-negative integer"),
    ({"usage": {"prompt_tokens_details": 3}}, "usage.prompt_tokens_details is not an object"),
    (chunk({"tool_calls": [{**TOOL_CALL, "function": {"name": "f", "arguments": {"a": 1}}}]}),
     "choices[0].delta.tool_calls[0].function.arguments is not a string"),
    (chunk({"tool_calls": [{**TOOL_CALL, "index": None}]}), "choices[0].delta.tool_calls[0].index is missing"),
    (chunk({"tool_calls": [{**TOOL_CALL, "function": "f"}]}), "choices[0].delta.tool_calls[0].function is not an object"),
    (chunk({"tool_calls": [{**TOOL_CALL, "id": 5}]}), "choices[0].delta.tool_calls[0].id is not a string"),
    (chunk({"tool_calls": {"0": TOOL_CALL}}), "choices[0].delta.tool_calls is not a list"),
    (chunk({"tool_calls": [7]}), "choices[0].delta.tool_calls[0] is not an object"),
    ({"choices": [{"delta": None}]}, "choices[0].delta is missing or null"),
    ({"choices": [{"index": 0}]}, "choices[0].delta is missing or null"),
    (chunk("text"), "choices[0].delta is not an object"),
    (chunk({"content": 5}), "choices[0].delta.content is not a string"),
    (chunk({"content": {"text": "x"}}), "choices[0].delta.content is not a string"),
    (chunk({"reasoning_content": ["x"]}), "choices[0].delta.reasoning_content is not a string"),
    (chunk({"reasoning": 1}), "choices[0].delta.reasoning is not a string"),
    (chunk({"content": "x"}, 3), "choices[0].finish_reason is not a string"),
    (chunk({"content": "x"}, index="0"), "choices[0].index is not a non-negative integer"),
]


@pytest.mark.parametrize(("value", "named"), MALFORMED_CHUNKS)
def test_malformed_chunks_are_refused_naming_the_field(value: Any, named: str) -> None:
    with pytest.raises(ShapeError) as info:
        check_chunk(value)
    assert str(info.value) == named


def test_a_completion_with_a_message_passes() -> None:
    value = completion(
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        prompt_token_ids=[1, 2],
    )
    value["choices"][0]["disaggregated_params"] = {"ctx_request_id": 9}
    assert check_completion(value) is value


MALFORMED_COMPLETIONS = [
    (completion("oops"), "choices[0].message is not an object"),  # issue 9: was an AttributeError
    (completion(None), "choices[0].message is missing or null"),
    (completion({"content": 5}), "choices[0].message.content is not a string"),
    (completion({"tool_calls": [{"function": {"arguments": {}}}]}), "choices[0].message.tool_calls[0].function.arguments is not a string"),
    (completion({"content": "x"}, usage=5), "usage is not an object"),
    ({"choices": []}, "choices is empty"),
    ({"choices": None}, "choices is not a list"),
    ({}, "choices is not a list"),
    ([], "the answer is not an object"),
]


@pytest.mark.parametrize(("value", "named"), MALFORMED_COMPLETIONS)
def test_malformed_completions_are_refused_naming_the_field(value: Any, named: str) -> None:
    with pytest.raises(ShapeError) as info:
        check_completion(value)
    assert str(info.value) == named


# --- what passes the checks is safe to read ------------------------------------------------------
# Random JSON over the chat vocabulary: whatever the checks let through must not crash the code
# that reads it (the protocols' completion_as_chunks, the front door's reframer) with anything
# but its own, deliberate error.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from messages_api.errors import AnthropicError  # noqa: E402
from messages_api.reframe import StreamReframer  # noqa: E402
from workers.protocols.base import completion_as_chunks  # noqa: E402

# Wrong values, truthy ones first: a falsy wrong value is mostly skipped by its readers.
JUNK = st.sampled_from([5, 1.5, True, [1], {"a": 1}, "x", -1, None, [], {}])


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The documented value, or a wrong one."""
    return st.one_of(valid, valid, JUNK)


TEXT = st.one_of(st.none(), st.sampled_from(["", "hi", " there"]))
COUNT = st.integers(min_value=0, max_value=50)
FUNCTION = st.fixed_dictionaries(
    {}, optional={"name": maybe(st.sampled_from([None, "get", "put"])), "arguments": maybe(st.sampled_from([None, "", '{"a":', " 1}", "{}"]))}
)
TOOL_CALL = st.fixed_dictionaries(
    {"index": maybe(st.integers(min_value=0, max_value=2))},
    optional={"id": maybe(st.sampled_from([None, "call_1", "call_2"])), "type": maybe(st.just("function")), "function": maybe(FUNCTION)},
)
BODY = st.fixed_dictionaries(
    {},
    optional={"role": maybe(st.just("assistant")), "content": maybe(TEXT), "reasoning_content": maybe(TEXT), "reasoning": maybe(TEXT),
              "tool_calls": maybe(st.lists(maybe(TOOL_CALL), max_size=2))},
)
FINISH = st.sampled_from([None, "stop", "length", "tool_calls"])
USAGE = st.fixed_dictionaries(
    {},
    optional={"prompt_tokens": maybe(COUNT), "completion_tokens": maybe(COUNT), "total_tokens": maybe(COUNT),
              "prompt_tokens_details": maybe(st.fixed_dictionaries({}, optional={"cached_tokens": maybe(COUNT)}))},
)


def answers(body_name: str) -> st.SearchStrategy[Any]:
    choice = st.fixed_dictionaries(
        {"index": maybe(st.just(0))}, optional={body_name: maybe(BODY), "finish_reason": maybe(FINISH), "stop_reason": JUNK}
    )
    return maybe(st.fixed_dictionaries({"choices": maybe(st.lists(maybe(choice), max_size=2))}, optional={"usage": maybe(USAGE), "id": TEXT}))


def reframe(chunks: list[Any]) -> None:
    reframer = StreamReframer(message_id="msg_1", model="m")
    events: list[dict[str, Any]] = []
    try:
        for item in chunks:
            events += reframer.feed(item)
        events += reframer.finish()
    except AnthropicError:
        pass  # a deliberate refusal (e.g. tool arguments that are not JSON), answered as such
    for event in events:
        delta = event.get("delta", {})
        for field in ("text", "thinking", "partial_json"):
            assert field not in delta or type(delta[field]) is str, event


def passes(check: Any, value: Any) -> bool:
    try:
        check(value)
    except ShapeError:
        return False
    return True


@settings(max_examples=500, deadline=None)
@given(st.lists(answers("delta"), min_size=1, max_size=6))
def test_chunks_that_pass_are_safe_for_the_reframer(values: list[Any]) -> None:
    reframe([value for value in values if passes(check_chunk, value)])


@settings(max_examples=500, deadline=None)
@given(answers("message"))
def test_completions_that_pass_become_chunks_that_pass(value: Any) -> None:
    if not passes(check_completion, value):
        return
    chunks = completion_as_chunks(value)
    for item in chunks:
        check_chunk(item)
    reframe(chunks)
