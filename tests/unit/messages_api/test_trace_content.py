"""Opt-in content recording for traces: the GenAI message schema, bounded."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages_api import trace_content
from messages_api.trace_content import MAX_ITEMS, ContentRecorder, input_messages, system_instructions


def content_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(p.get("content", p.get("arguments", p.get("result", ""))))) for m in messages for p in m["parts"])


def test_blocks_map_to_genai_parts_and_data_is_never_recorded() -> None:
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "SECRETPIXELS"}},
        ]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "read", "input": {"path": "/a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text", "text": "file"}]}]},
    ]  # fmt: skip
    recorded, omitted = input_messages(messages, 1000)
    assert omitted == 0
    assert recorded == [
        {"role": "user", "parts": [{"type": "text", "content": "look"}, {"type": "image"}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "tu_1", "name": "read", "arguments": '{"path":"/a"}'}]},
        {"role": "user", "parts": [{"type": "tool_call_response", "id": "tu_1", "result": "file"}]},
    ]
    assert "SECRETPIXELS" not in repr(recorded)
    assert system_instructions("be brief", 3) == [{"type": "text", "content": "be "}]


def test_the_latest_messages_are_kept_within_the_budget() -> None:
    messages = [{"role": "user", "content": f"message {n} " + "x" * 50} for n in range(10)]
    recorded, omitted = input_messages(messages, 120)
    assert recorded[-1]["parts"][0]["content"].startswith("message 9 ")
    assert content_chars(recorded) == 120 and omitted == 10 - len(recorded)


@given(st.lists(st.text(max_size=300), max_size=300), st.integers(min_value=0, max_value=2000))
def test_never_more_than_the_budget_nor_max_items(texts: list[str], limit: int) -> None:
    recorded, omitted = input_messages([{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}] * 3, limit)
    assert content_chars(recorded) <= limit
    assert len(recorded) + omitted == 3 and all(len(m["parts"]) <= MAX_ITEMS for m in recorded)


class Annotations:
    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}

    def annotate(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)


def test_the_answer_is_collected_from_the_relayed_chunks_up_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    span = Annotations()
    monkeypatch.setattr(trace_content, "tracing", span)
    recorder = ContentRecorder(10)
    seen: list[dict[str, Any]] = []
    sink = recorder.wrap(seen.append)
    chunks = [
        {"choices": [{"delta": {"content": "Hello "}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}}]},
        {"choices": [{"delta": {"content": "world, and more"}}]},
        {"choices": [], "usage": {"completion_tokens": 3}},
    ]
    for chunk in chunks:
        sink(chunk)
    assert seen == chunks  # every chunk still reaches the sink
    recorder.finish("end_turn")
    # 6 characters of text and 4 of the call's arguments: the budget spent, the rest not taken.
    assert orjson.loads(span.attributes["gen_ai.output.messages"]) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "Hello "}, {"type": "tool_call", "id": "c1", "name": "f", "arguments": '{"a"'}],
            "finish_reason": "end_turn",
        }
    ]
