"""The tokenizer-free prompt estimate: the byte count stands for the regex it replaced (equal on
ASCII text, within 2 pieces per non-ASCII character otherwise), and the chat walk counts every part."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from messages_api.convert import to_chat_request
from workers.schedule.prompt_tokens import _PER_IMAGE, _PER_MESSAGE, _text_tokens, estimate_prompt_tokens

_PIECE = re.compile(r"\w+|[^\w\s]")


def regex_pieces(text: str) -> int:
    """The count as the estimate defines it (and computed it before the byte classes)."""
    return len(_PIECE.findall(text))


# Characters the byte classes must tell apart: ASCII (controls, \x1c-\x1f which \s includes, DEL),
# non-ASCII letters, symbols (em dash, emoji), spaces (NBSP, ideographic), combining marks,
# and lone surrogates, which a str from outside the JSON parser may hold.
_TRICKY = "a_Z9 \t\n\r\x0b\x0c\x1c\x1f\x00\x7f!\"'\\-.éß中—…😀\u00a0\u3000\u0301\u0661\ud800"


@given(st.text(alphabet=st.characters(max_codepoint=127)))
def test_equal_to_the_regex_on_ascii_text(text: str) -> None:
    assert _text_tokens(text) == regex_pieces(text)


@given(st.text() | st.text(alphabet=_TRICKY))
def test_within_two_pieces_per_non_ascii_character_of_the_regex(text: str) -> None:
    non_ascii = sum(1 for c in text if not c.isascii())
    assert abs(_text_tokens(text) - regex_pieces(text)) <= 2 * non_ascii


def test_where_the_byte_count_differs_from_the_regex() -> None:
    # Non-ASCII letters are words to both; a non-ASCII symbol or space joins its neighbours.
    assert _text_tokens("naïve café 中文") == regex_pieces("naïve café 中文") == 3
    assert (_text_tokens("a—b"), regex_pieces("a—b")) == (1, 3)
    assert (_text_tokens("a\u00a0b"), regex_pieces("a\u00a0b")) == (1, 2)
    assert _text_tokens("") == 0 and _text_tokens(" \x1c\x1f ") == 0
    assert _text_tokens("x, y;z") == regex_pieces("x, y;z") == 5


def test_the_chat_walk_counts_messages_calls_reasoning_images_and_tools() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "strict": True}}}
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What's up?"}, {"type": "image_url", "image_url": {"url": "x"}}, "junk"]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think it over",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
            },
        ],
        "tools": [tool],
    }
    # Pieces: "Be brief." 3; "What's up?" 5; "get_weather" 1; '{"city": "Paris"}' 9; "think it over" 3;
    # the tool over its compact JSON (orjson's), the "junk" part not at all.
    tool_json = json.dumps(tool, separators=(",", ":"))
    expected = 3 * _PER_MESSAGE + 3 + 5 + _PER_IMAGE + 1 + 9 + 3 + regex_pieces(tool_json)
    assert estimate_prompt_tokens(chat) == expected


def test_a_tool_orjson_cannot_write_is_counted_by_its_repr() -> None:
    tool = {"type": "function", "function": {"name": "big", "parameters": {"maximum": 2**70}}}
    assert estimate_prompt_tokens({"tools": [tool]}) == regex_pieces(str(tool))


def test_claude_codes_request_is_estimated_as_the_regex_counted_it() -> None:
    """The replayed Claude Code request: the messages are ASCII but for a few characters, so the
    estimate stays within 1 % of the regex count over the same texts (tools over their JSON)."""
    fixture = json.loads((Path(__file__).resolve().parents[3] / "fixtures" / "claude_code_request.json").read_text())["body"]
    chat = to_chat_request({**fixture, "model": "m", "max_tokens": 4})
    by_regex = 0
    for message in chat["messages"]:
        content = message.get("content")
        texts = [content] if isinstance(content, str) else [p["text"] for p in content or () if p.get("type") == "text"]
        by_regex += _PER_MESSAGE + sum(regex_pieces(t) for t in texts)
        by_regex += sum(regex_pieces(c["function"]["name"]) + regex_pieces(c["function"]["arguments"]) for c in message.get("tool_calls") or ())
    by_regex += sum(regex_pieces(json.dumps(t, ensure_ascii=False, separators=(",", ":"))) for t in chat["tools"])
    estimate = estimate_prompt_tokens(chat)
    assert by_regex > 15_000
    assert abs(estimate - by_regex) <= by_regex // 100


def test_a_tool_list_seen_before_is_counted_from_its_hash_and_a_changed_one_anew() -> None:
    import orjson

    from workers.schedule import prompt_tokens

    def chat(description: str) -> dict[str, object]:
        return {"messages": [], "tools": [{"type": "function", "function": {"name": "t", "description": description}}]}

    first, changed = chat("reads a file"), chat("reads a file, or writes it")
    expected = estimate_prompt_tokens(first)  # counted tool by tool, no cache involved
    prompt_tokens._tools_pieces_by_hash.clear()
    assert estimate_prompt_tokens(first, tools_json=orjson.dumps(first["tools"])) == expected
    assert len(prompt_tokens._tools_pieces_by_hash) == 1
    assert estimate_prompt_tokens(first, tools_json=orjson.dumps(first["tools"])) == expected  # from the cache
    assert estimate_prompt_tokens(changed, tools_json=orjson.dumps(changed["tools"])) == estimate_prompt_tokens(changed) == expected + 4
    assert len(prompt_tokens._tools_pieces_by_hash) == 2


@given(st.text(alphabet=st.sampled_from(list("ab c\n.é😀,\t-\\")), max_size=200), st.integers(min_value=1, max_value=17))
def test_a_long_text_counted_in_slices_counts_as_in_one(text: str, slice_chars: int) -> None:
    from workers.schedule import prompt_tokens

    whole = prompt_tokens._pieces(text.encode("utf-8"))
    original = prompt_tokens._TEXT_SLICE
    prompt_tokens._TEXT_SLICE = slice_chars
    try:
        assert prompt_tokens._text_tokens(text) == whole
    finally:
        prompt_tokens._TEXT_SLICE = original
