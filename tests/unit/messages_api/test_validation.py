"""Request validation (`messages_api.validation`): pure, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from messages_api.errors import AnthropicError
from messages_api.validation import (
    validate_count_tokens_request,
    validate_messages_request,
)
from tests.support.requests import claude_code_body


def minimal(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return body


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def error_of(body: object, count_tokens: bool = False) -> str:
    validate = validate_count_tokens_request if count_tokens else validate_messages_request
    with pytest.raises(AnthropicError) as info:
        validate(body)
    assert info.value.status == 400
    assert info.value.error_type == "invalid_request_error"
    return info.value.message


# -- accepted -----------------------------------------------------------------------------------


def test_minimal_body_is_returned_as_is() -> None:
    body = minimal()
    assert validate_messages_request(body) is body


def test_claude_code_body_with_its_extra_fields_is_accepted() -> None:
    body = claude_code_body()
    assert validate_messages_request(body) is body


def test_unknown_top_level_fields_are_tolerated() -> None:
    validate_messages_request(
        minimal(
            context_management={"edits": []},
            diagnostics={},
            service_tier="standard_only",
            container="cntr_1",
            cache_control={"type": "ephemeral"},
            betas=["x"],
            inference_geo="us",
            mcp_servers=[],
            speed="fast",
            some_future_field={"nested": True},
        )
    )


def test_null_optional_fields_count_as_absent() -> None:
    validate_messages_request(
        minimal(system=None, stream=None, temperature=None, tools=None, tool_choice=None, thinking=None, metadata=None)
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"system": "s"},
        {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]},
        {"stream": False},
        {"temperature": 0},
        {"temperature": 1},
        {"temperature": 0.7, "top_p": 0.95, "top_k": 0},
        {"stop_sequences": []},
        {"stop_sequences": ["END", "\n\nHuman:"]},
        {"tools": [], "tool_choice": {"type": "none"}},
        {"tool_choice": {"type": "tool", "name": "x", "disable_parallel_tool_use": True}},
        {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]},
        {"tools": [{"type": "browser_toolset_20260801"}]},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1025},
        {"thinking": {"type": "adaptive", "display": "summarized"}},
        {"thinking": {"type": "disabled"}},
        {"metadata": {"user_id": None}},
        {"metadata": {}},
        {"output_config": {"effort": "max", "format": {"type": "json_schema", "schema": {"type": "object"}}}},
    ],
)
def test_valid_optional_fields(fields: dict[str, Any]) -> None:
    validate_messages_request(minimal(**fields))


def test_every_request_block_shape_is_accepted() -> None:
    validate_messages_request(
        minimal(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "t", "citations": []},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "d"}},
                        {"type": "search_result", "source": "s", "title": "t", "content": [{"type": "text", "text": "x"}]},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "th", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "d"},
                        {"type": "tool_use", "id": "t1", "name": "n", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "is_error": True,
                            "content": [
                                {"type": "text", "text": "x"},
                                {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                            ],
                        }
                    ],
                },
                {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            ]
        )
    )


# -- rejected: top level ------------------------------------------------------------------------


@pytest.mark.parametrize("body", [None, [], "text", 3, True])
def test_body_must_be_an_object(body: object) -> None:
    assert error_of(body) == "The request body must be a JSON object"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (without(minimal(), "model"), "model: Field required"),
        (minimal(model=None), "model: Field required"),
        (minimal(model=7), "model: Input should be a valid string"),
        (minimal(model=""), "model: String should have at least 1 character"),
        (without(minimal(), "max_tokens"), "max_tokens: Field required"),
        (minimal(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
        (minimal(max_tokens=-5), "max_tokens: Input should be greater than or equal to 1"),
        (minimal(max_tokens=True), "max_tokens: Input should be a valid integer"),
        (minimal(max_tokens=12.5), "max_tokens: Input should be a valid integer"),
        (minimal(max_tokens="100"), "max_tokens: Input should be a valid integer"),
        (without(minimal(), "messages"), "messages: Field required"),
        (minimal(messages=[]), "messages: at least one message is required"),
        (minimal(messages={"role": "user"}), "messages: Input should be a valid list"),
        (minimal(stream="yes"), "stream: Input should be a valid boolean"),
        (minimal(temperature=1.5), "temperature: Input should be less than or equal to 1"),
        (minimal(temperature=-0.1), "temperature: Input should be greater than or equal to 0"),
        (minimal(temperature="0.5"), "temperature: Input should be a valid number"),
        (minimal(temperature=True), "temperature: Input should be a valid number"),
        (minimal(top_p=2), "top_p: Input should be less than or equal to 1"),
        (minimal(top_k=-1), "top_k: Input should be greater than or equal to 0"),
        (minimal(top_k=2.5), "top_k: Input should be a valid integer"),
        (minimal(stop_sequences="END"), "stop_sequences: Input should be a valid list"),
        (minimal(stop_sequences=["a", 3]), "stop_sequences.1: Input should be a valid string"),
        (minimal(system=5), "system: Input should be a valid string or a list of text blocks"),
        (
            minimal(system=[{"type": "image", "source": {}}]),
            "system.0.type: Input tag 'image' found using 'type' does not match any of the expected tags: 'text'",
        ),
        (minimal(system=[{"type": "text"}]), "system.0.text: Field required"),
        (minimal(metadata="u"), "metadata: Input should be a valid dictionary"),
        (minimal(metadata={"user_id": 5}), "metadata.user_id: Input should be a valid string"),
        (minimal(output_config={"effort": 3}), "output_config.effort: Input should be a valid string"),
        (
            minimal(output_config={"format": {"type": "regex"}}),
            "output_config.format.type: Input tag 'regex' found using 'type' does not match any of the expected tags: 'json_schema'",
        ),
        (minimal(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema: Field required"),
    ],
)
def test_top_level_errors_name_the_field(body: dict[str, Any], message: str) -> None:
    assert error_of(body) == message


# -- rejected: tools, tool_choice, thinking -----------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": {"name": "x"}}, "tools: Input should be a valid list"),
        ({"tools": ["x"]}, "tools.0: Input should be a valid dictionary"),
        ({"tools": [{"input_schema": {}}]}, "tools.0.name: Field required"),
        ({"tools": [{"name": "", "input_schema": {}}]}, "tools.0.name: String should have at least 1 character"),
        ({"tools": [{"name": "a", "input_schema": {}}, {"name": "b"}]}, "tools.1.input_schema: Field required"),
        ({"tools": [{"name": "a", "input_schema": "{}"}]}, "tools.0.input_schema: Input should be a valid dictionary"),
        ({"tools": [{"name": "a", "input_schema": {}, "description": 1}]}, "tools.0.description: Input should be a valid string"),
        ({"tools": [{"type": 5, "name": "a"}]}, "tools.0.type: Input should be a valid string"),
        ({"tool_choice": "auto"}, "tool_choice: Input should be a valid dictionary"),
        ({"tool_choice": {}}, "tool_choice.type: Field required"),
        (
            {"tool_choice": {"type": "required"}},
            "tool_choice.type: Input tag 'required' found using 'type' does not match any of the expected tags: 'auto', 'any', 'tool', 'none'",
        ),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name: Field required"),
        (
            {"tool_choice": {"type": "auto", "disable_parallel_tool_use": "no"}},
            "tool_choice.disable_parallel_tool_use: Input should be a valid boolean",
        ),
        ({"thinking": True}, "thinking: Input should be a valid dictionary"),
        (
            {"thinking": {"type": "on"}},
            "thinking.type: Input tag 'on' found using 'type' does not match any of the expected tags: 'enabled', 'disabled', 'adaptive'",
        ),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens: Field required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens: Input should be greater than or equal to 1024"),
        ({"thinking": {"type": "enabled", "budget_tokens": "2000"}}, "thinking.budget_tokens: Input should be a valid integer"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048}, "`max_tokens` must be greater than `thinking.budget_tokens`"),
        ({"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 1024}, "`max_tokens` must be greater than `thinking.budget_tokens`"),
    ],
)
def test_tool_and_thinking_errors_name_the_field(fields: dict[str, Any], message: str) -> None:
    assert error_of(minimal(**fields)) == message


# -- rejected: messages and blocks --------------------------------------------------------------


def conversation(*content: Any) -> dict[str, Any]:
    """Three messages; the third carries `content`."""
    return minimal(
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": list(content)}]
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (minimal(messages=["hi"]), "messages.0: Input should be a valid dictionary"),
        (minimal(messages=[{"content": "hi"}]), "messages.0.role: Field required"),
        (minimal(messages=[{"role": "tool", "content": "hi"}]), "messages.0.role: Input should be 'user', 'assistant' or 'system'"),
        (minimal(messages=[{"role": "user"}]), "messages.0.content: Field required"),
        (minimal(messages=[{"role": "user", "content": 5}]), "messages.0.content: Input should be a valid string or a list of content blocks"),
        (conversation("text"), "messages.2.content.0: Input should be a valid dictionary"),
        (conversation({"text": "x"}), "messages.2.content.0.type: Field required"),
        (conversation({"type": 1}), "messages.2.content.0.type: Input should be a valid string"),
        (conversation({"type": "text", "text": None}), "messages.2.content.0.text: Field required"),
        (conversation({"type": "text", "text": 5}), "messages.2.content.0.text: Input should be a valid string"),
        (conversation({"type": "image"}), "messages.2.content.0.source: Field required"),
        (
            conversation({"type": "image", "source": {"type": "path"}}),
            "messages.2.content.0.source.type: Input tag 'path' found using 'type' does not match any of the expected tags: 'base64', 'url', 'file'",
        ),
        (conversation({"type": "image", "source": {"type": "base64", "data": "AA"}}), "messages.2.content.0.source.media_type: Field required"),
        (conversation({"type": "image", "source": {"type": "url"}}), "messages.2.content.0.source.url: Field required"),
        (conversation({"type": "document", "source": "text"}), "messages.2.content.0.source: Input should be a valid dictionary"),
        (conversation({"type": "tool_use", "id": "t", "name": "n"}), "messages.2.content.0.input: Field required"),
        (conversation({"type": "tool_use", "id": "t", "name": "n", "input": "{}"}), "messages.2.content.0.input: Input should be a valid dictionary"),
        (conversation({"type": "tool_result"}), "messages.2.content.0.tool_use_id: Field required"),
        (
            conversation({"type": "tool_result", "tool_use_id": "t", "content": 5}),
            "messages.2.content.0.content: Input should be a valid string or a list of content blocks",
        ),
        (
            conversation({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}),
            "messages.2.content.0.is_error: Input should be a valid boolean",
        ),
        (conversation({"type": "thinking", "signature": "s"}), "messages.2.content.0.thinking: Field required"),
        (conversation({"type": "search_result", "content": "x"}), "messages.2.content.0.content: Input should be a valid list"),
        (
            minimal(messages=[{"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]),
            "messages.0.content.0.type: Input tag 'image' found using 'type' does not match any of the expected tags: 'text'",
        ),
    ],
)
def test_message_errors_name_the_path(body: dict[str, Any], message: str) -> None:
    assert error_of(body) == message


def test_unknown_block_tag_lists_the_expected_tags() -> None:
    message = error_of(conversation({"type": "text", "text": "ok"}, {"type": "foo"}))
    assert message.startswith(
        "messages.2.content.1.type: Input tag 'foo' found using 'type' does not match any of the expected tags: "
        "'text', 'image', 'document', 'search_result', 'thinking', 'redacted_thinking', 'tool_use', 'tool_result'"
    )


def test_unknown_block_tag_inside_a_tool_result_names_its_path() -> None:
    message = error_of(conversation({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "thinking", "thinking": "x"}]}))
    assert message == (
        "messages.2.content.0.content.0.type: Input tag 'thinking' found using 'type' does not match any of the "
        "expected tags: 'text', 'image', 'document', 'search_result', 'tool_reference'"
    )


# -- count_tokens -------------------------------------------------------------------------------


def test_count_tokens_needs_no_max_tokens() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "s", "tools": []}
    assert validate_count_tokens_request(body) is body


def test_count_tokens_checks_the_budget_floor_but_not_against_max_tokens() -> None:
    validate_count_tokens_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 50000}}
    )
    message = error_of(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 10}}, count_tokens=True
    )
    assert message == "thinking.budget_tokens: Input should be greater than or equal to 1024"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "model: Field required"),
        ({"model": "m"}, "messages: Field required"),
        ({"model": "m", "messages": []}, "messages: at least one message is required"),
        ([], "The request body must be a JSON object"),
    ],
)
def test_count_tokens_required_fields(body: object, message: str) -> None:
    assert error_of(body, count_tokens=True) == message


def test_claude_code_count_tokens_body_is_accepted() -> None:
    body = claude_code_body()
    for key in ("max_tokens", "stream", "metadata"):
        del body[key]
    validate_count_tokens_request(body)
