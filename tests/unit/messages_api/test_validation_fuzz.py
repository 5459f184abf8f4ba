"""Property: whatever JSON a client puts anywhere in a request, validation and conversion either
produce a worker request that encodes, or raise a 400 `invalid_request_error` — never anything
else (which the consumer would answer with a 500).

A rich valid request (every block type, nested tool results and document sources, every
optional field) is mutated at random paths: a value replaced by arbitrary JSON (often shaped like
a block, so the deeper checks are reached), a key removed, or a value nested deep. Bounded
(`max_examples`) so the suite stays fast.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from messages_api.convert import to_chat_request
from messages_api.errors import AnthropicError
from messages_api.validation import (
    MESSAGE_BLOCK_TAGS,
    validate_count_tokens_request,
    validate_messages_request,
)

FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def rich_request() -> dict[str, Any]:
    """A new copy each time: mutations must never reach a shared object (such as IMAGE)."""
    return copy.deepcopy(_rich_request())


def _rich_request() -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 4096,
        "stream": True,
        "system": [{"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["END"],
        "metadata": {"user_id": "user_1"},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}},
        "tools": [
            {
                "name": "read",
                "description": "Read a file",
                "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            }
        ],
        "tool_choice": {"type": "tool", "name": "read", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look at these.", "citations": []},
                    IMAGE,
                    {"type": "image", "source": {"type": "base64", "media_type": "image/webp", "data": "UklGR"}},
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Doc."}, "title": "T"},
                    {
                        "type": "document",
                        "source": {"type": "content", "content": [{"type": "text", "text": "Inline."}, IMAGE]},
                        "context": "From the wiki",
                    },
                    {"type": "search_result", "source": "https://s", "title": "S", "content": [{"type": "text", "text": "found"}]},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Read it.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.txt", "opts": {"n": [1, 2]}}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "is_error": False,
                        "content": [
                            {"type": "text", "text": "file body"},
                            IMAGE,
                            {"type": "document", "source": {"type": "content", "content": "inner"}},
                            {"type": "search_result", "source": "s", "title": "t", "content": [{"type": "text", "text": "x"}]},
                        ],
                    },
                    {"type": "text", "text": "Go on."},
                ],
            },
        ],
    }


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key and index path in `value` (the root excluded)."""
    found: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found.append((*prefix, key))
        found.extend(paths(child, (*prefix, key)))
    return found


RICH_PATHS = paths(rich_request())

FIELD_NAMES = (
    "type", "text", "source", "content", "data", "media_type", "url", "file_id", "id", "name", "input",
    "tool_use_id", "is_error", "thinking", "signature", "title", "context", "citations", "role", "schema",
)
TAGS = (*MESSAGE_BLOCK_TAGS, "base64", "url", "file", "content", "tool_reference", "json_schema", "enabled", "auto", "tool")

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(TAGS)
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), children, max_size=5),
    max_leaves=16,
)


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


# Block-shaped values: each block type with all its fields, each either a valid value or any
# JSON at all (None standing for a missing field), and sources and nested blocks shaped in turn,
# so the checks below the tag are reached.
def either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, JSON)


def shaped(tag: str, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": st.just(tag), **{name: either(valid) for name, valid in fields.items()}})


TEXT = st.text(max_size=8)
SOURCES = st.deferred(
    lambda: st.one_of(
        shaped("base64", media_type=TEXT, data=TEXT),
        shaped("text", media_type=TEXT, data=TEXT),
        shaped("url", url=TEXT),
        shaped("file", file_id=TEXT),
        shaped("content", content=TEXT | st.lists(BLOCK, max_size=3)),
    )
)
BLOCK: st.SearchStrategy[Any] = st.deferred(
    lambda: st.one_of(
        shaped("text", text=TEXT),
        shaped("image", source=SOURCES),
        shaped("document", source=SOURCES, title=TEXT, context=TEXT),
        shaped("search_result", source=TEXT, title=TEXT, content=st.lists(BLOCK, max_size=3)),
        shaped("thinking", thinking=TEXT, signature=TEXT),
        shaped("redacted_thinking", data=TEXT),
        shaped("tool_use", id=TEXT, name=TEXT, input=st.dictionaries(TEXT, JSON, max_size=3)),
        shaped("tool_result", tool_use_id=TEXT, is_error=st.booleans(), content=TEXT | st.lists(BLOCK, max_size=3)),
        shaped("tool_reference", tool_name=TEXT),
        st.fixed_dictionaries({"type": st.sampled_from(MESSAGE_BLOCK_TAGS)}),
    )
)


# Where the rich request holds a content block (a turn's, a tool result's, a document source's).
BLOCK_PATHS = [p for p in RICH_PATHS if len(p) >= 2 and p[-2] == "content" and isinstance(p[-1], int)]

MUTATION = st.tuples(st.sampled_from(RICH_PATHS), st.one_of(JSON, BLOCK, st.just("<delete>")))
BLOCK_MUTATION = st.tuples(st.sampled_from(BLOCK_PATHS), BLOCK)
# Depths around the limit (64, counted from the body) and orjson's encoder's (254).
DEPTHS = (1, 30, 58, 59, 60, 61, 62, 63, 64, 65, 128, 252, 253, 254, 255, 256, 400)


def mutated(mutations: list[tuple[tuple[Any, ...], Any]]) -> dict[str, Any]:
    body = rich_request()
    for path, value in mutations:
        parent: Any = body
        for key in path[:-1]:
            try:
                parent = parent[key]
            except (KeyError, IndexError, TypeError):
                break  # an earlier mutation changed this part of the tree
        else:
            if isinstance(parent, dict) and not isinstance(path[-1], str):
                # An earlier mutation put an object where this path expects an array: JSON
                # objects have only string keys, so no request body can hold this one.
                continue
            try:
                if value == "<delete>":
                    if isinstance(parent, dict):
                        parent.pop(path[-1], None)
                    elif isinstance(parent, list) and path[-1] < len(parent):
                        del parent[path[-1]]
                else:
                    parent[path[-1]] = copy.deepcopy(value)
            except (KeyError, IndexError, TypeError):
                pass
    return body


def handled(body: Any, *, count_tokens: bool = False) -> bool:
    """True when the request converts (and its worker request encodes); False on a 400."""
    try:
        if count_tokens:
            request = validate_count_tokens_request(body)
            chat = to_chat_request({**request, "max_tokens": 1})
        else:
            chat = to_chat_request(validate_messages_request(body))
        orjson.dumps(chat)
    except AnthropicError as error:
        assert (error.status, error.error_type) == (400, "invalid_request_error"), repr(error)
        return False
    return True


def test_the_rich_request_itself_is_valid() -> None:
    assert handled(rich_request())
    assert handled(rich_request(), count_tokens=True)


@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=3))
def test_any_json_anywhere_gives_a_request_or_a_400(mutations: list[tuple[tuple[Any, ...], Any]]) -> None:
    handled(mutated(mutations))


@FUZZ
@given(st.lists(BLOCK_MUTATION, min_size=1, max_size=3))
# The 500s issue 9 reported, always tried first: a document's content source that is a number,
# an image without source, a text that is a number, a URL source without its URL (directly and
# inside a tool result).
@example([(("messages", 1, "content", 0), {"type": "document", "source": {"type": "content", "content": 5}})])
@example([(("messages", 3, "content", 0, "content", 0), {"type": "document", "source": {"type": "content", "content": 5}})])
@example([(("messages", 1, "content", 0), {"type": "image"})])
@example([(("messages", 3, "content", 0, "content", 1), {"type": "image"})])
@example([(("messages", 1, "content", 0), {"type": "text", "text": 7})])
@example([(("messages", 1, "content", 0), {"type": "image", "source": {"type": "url"}})])
@example([(("messages", 3, "content", 0, "content", 1), {"type": "image", "source": {"type": "url"}})])
def test_any_block_anywhere_gives_a_request_or_a_400(mutations: list[tuple[tuple[Any, ...], Any]]) -> None:
    handled(mutated(mutations))


def test_any_nesting_anywhere_gives_a_request_or_a_400() -> None:
    # Exhaustive rather than sampled: every path, at depths around both limits.
    for path in RICH_PATHS:
        for depth in DEPTHS:
            handled(mutated([(path, nested(depth))]))


@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=2))
def test_count_tokens_too(mutations: list[tuple[tuple[Any, ...], Any]]) -> None:
    body = mutated(mutations)
    body.pop("max_tokens", None)
    handled(body, count_tokens=True)


@FUZZ
@given(JSON)
def test_any_json_as_the_whole_body_gives_a_400_or_a_request(body: Any) -> None:
    handled(body)
