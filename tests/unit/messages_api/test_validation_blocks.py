"""Every content block validated to the field (messages_api.validation), directly, inside a
tool_result and inside a document's content source; and the nesting-depth limit. Each case here
was a 500 (the converter or the worker request's encoder failing on it) or is its neighbour."""

from __future__ import annotations

from typing import Any

import pytest

from messages_api.convert import to_chat_request
from messages_api.errors import AnthropicError
from messages_api.validation import validate_messages_request

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def user(*blocks: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": list(blocks)}]}


def in_tool_result(block: dict[str, Any]) -> dict[str, Any]:
    return user({"type": "tool_result", "tool_use_id": "toolu_1", "content": [block]})


def error_of(body: dict[str, Any]) -> str:
    with pytest.raises(AnthropicError) as info:
        to_chat_request(validate_messages_request(body))
    assert (info.value.status, info.value.error_type) == (400, "invalid_request_error")
    return info.value.message


BAD_BLOCKS = [
    ({"type": "text", "text": 7}, "text: Input should be a valid string"),
    ({"type": "text", "text": "x", "citations": 5}, "citations: Input should be a valid list"),
    ({"type": "image"}, "source: Field required"),
    ({"type": "image", "source": "x"}, "source: Input should be a valid dictionary"),
    ({"type": "image", "source": {"type": "url"}}, "source.url: Field required"),
    ({"type": "image", "source": {"type": "url", "url": 5}}, "source.url: Input should be a valid string"),
    ({"type": "image", "source": {"type": "base64", "data": "x"}}, "source.media_type: Field required"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": []}}, "source.data: Input should be a valid string"),
    ({"type": "image", "source": {"type": "file"}}, "source.file_id: Field required"),
    (
        {"type": "image", "source": {"type": "text", "data": "x"}},
        "source.type: Input tag 'text' found using 'type' does not match any of the expected tags: 'base64', 'url', 'file'",
    ),
    ({"type": "document", "source": {"type": "content", "content": 5}}, "source.content: Input should be a valid string or a list of content blocks"),
    ({"type": "document", "source": {"type": "content"}}, "source.content: Field required"),
    ({"type": "document", "source": {"type": "content", "content": [5]}}, "source.content.0: Input should be a valid dictionary"),
    (
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": 1}]}},
        "source.content.0.text: Input should be a valid string",
    ),
    ({"type": "document", "source": {"type": "content", "content": [{"type": "image"}]}}, "source.content.0.source: Field required"),
    (
        {"type": "document", "source": {"type": "content", "content": [{"type": "document"}]}},
        "source.content.0.type: Input tag 'document' found using 'type' does not match any of the expected tags: 'text', 'image'",
    ),
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": 5}}, "source.data: Input should be a valid string"),
    ({"type": "document", "source": {"type": "text", "data": "x"}}, "source.media_type: Field required"),
    ({"type": "document", "source": {"type": "base64", "media_type": "application/pdf"}}, "source.data: Field required"),
    ({"type": "document", "source": {"type": "url"}}, "source.url: Field required"),
    ({"type": "document", "source": {"type": "file", "file_id": 3}}, "source.file_id: Input should be a valid string"),
    ({"type": "document", "source": {"type": "pdf"}}, "source.type: Input tag 'pdf' found using 'type'"),
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}, "title": 5}, "title: Input should be a valid string"),
    (
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}, "context": {}},
        "context: Input should be a valid string",
    ),
    ({"type": "search_result", "content": [{"type": "text", "text": "x"}], "title": "t"}, "source: Field required"),
    ({"type": "search_result", "content": [{"type": "text", "text": "x"}], "source": "s", "title": 1}, "title: Input should be a valid string"),
    ({"type": "search_result", "content": [{"type": "text"}], "source": "s", "title": "t"}, "content.0.text: Field required"),
]


@pytest.mark.parametrize(("block", "message"), BAD_BLOCKS)
def test_a_bad_user_block_is_a_400_naming_the_field(block: dict[str, Any], message: str) -> None:
    assert error_of(user(block)).startswith(f"messages.0.content.0.{message}")


@pytest.mark.parametrize(("block", "message"), [case for case in BAD_BLOCKS if case[0]["type"] != "text" or "citations" not in case[0]])
def test_the_same_inside_a_tool_result(block: dict[str, Any], message: str) -> None:
    assert error_of(in_tool_result(block)).startswith(f"messages.0.content.0.content.0.{message}")


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"type": "thinking", "thinking": 1}, "thinking: Input should be a valid string"),
        ({"type": "thinking", "thinking": "x", "signature": 5}, "signature: Input should be a valid string"),
        ({"type": "redacted_thinking"}, "data: Field required"),
        ({"type": "redacted_thinking", "data": 5}, "data: Input should be a valid string"),
        ({"type": "tool_use", "id": "t", "name": "n", "input": []}, "input: Input should be a valid dictionary"),
        ({"type": "tool_use", "id": 1, "name": "n", "input": {}}, "id: Input should be a valid string"),
    ],
)
def test_a_bad_assistant_block_is_a_400_naming_the_field(block: dict[str, Any], message: str) -> None:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [block]}]}
    assert error_of(body).startswith(f"messages.1.content.0.{message}")


def test_a_thinking_block_without_a_signature_is_accepted() -> None:
    # The gateway's own thinking blocks carry an empty one, and an open model cannot check it.
    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}],
    }
    assert to_chat_request(validate_messages_request(body))["messages"][1]["reasoning_content"] == "x"


def test_valid_document_content_sources_still_convert() -> None:
    body = user(
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a"}, IMAGE]}, "title": "T"},
        {"type": "document", "source": {"type": "content", "content": "b"}},
    )
    parts = to_chat_request(validate_messages_request(body))["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text"]


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("depth", [70, 254, 300, 1000])
def test_deep_nesting_in_a_tool_schema_or_tool_input_is_a_400(depth: int, settings: Any) -> None:
    settings.MESSAGES_MAX_JSON_DEPTH = 64
    schema = {"name": "t", "input_schema": nested(depth)}
    assert error_of({**user({"type": "text", "text": "x"}), "tools": [schema]}) == "tools: JSON nested deeper than the limit of 64 levels"
    tool_use = {"type": "tool_use", "id": "t", "name": "n", "input": nested(depth)}
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [tool_use]}]}
    assert error_of(body) == "messages: JSON nested deeper than the limit of 64 levels"


def test_nesting_up_to_the_limit_is_accepted(settings: Any) -> None:
    settings.MESSAGES_MAX_JSON_DEPTH = 64
    # body(1) > tools(2) > the tool(3) > input_schema(4) > ... : 61 levels of schema reach 64.
    body = {**user({"type": "text", "text": "x"}), "tools": [{"name": "t", "input_schema": nested(61)}]}
    to_chat_request(validate_messages_request(body))
    body["tools"][0]["input_schema"] = nested(62)
    assert "deeper than the limit" in error_of(body)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"type": "base64", "media_type": "text/html", "data": "PGI+"},
            "messages.0.content.0.source.media_type: Input should be 'image/jpeg', 'image/png', 'image/gif' or 'image/webp'",
        ),
        (
            {"type": "base64", "media_type": "image/svg+xml", "data": "PHN2Zz4="},
            "messages.0.content.0.source.media_type: Input should be 'image/jpeg', 'image/png', 'image/gif' or 'image/webp'",
        ),
    ],
)
def test_a_base64_image_needs_one_of_the_apis_media_types(source: dict[str, Any], message: str) -> None:
    assert error_of(user({"type": "image", "source": source})) == message


def test_a_document_source_needs_its_own_media_type() -> None:
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "image/png", "data": "JVBE"}}
    assert error_of(user(pdf)) == "messages.0.content.0.source.media_type: Input should be 'application/pdf'"
    text = {"type": "document", "source": {"type": "text", "media_type": "text/html", "data": "<b>"}}
    assert error_of(user(text)) == "messages.0.content.0.source.media_type: Input should be 'text/plain'"
