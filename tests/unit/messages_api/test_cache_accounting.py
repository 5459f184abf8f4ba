"""Anthropic's cache accounting: the prompt up to its last `cache_control` breakpoint that the
worker did not read from its cache is reported as cache creation; input, creation and read add up
to the prompt in every place usage appears."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages_api.cache_accounting import cached_prefix_share, split_prompt
from messages_api.reframe import StreamReframer


def request(*, system_cached: bool = False, last_cached: bool = False) -> dict[str, Any]:
    system = [{"type": "text", "text": "You are helpful. " * 50, **({"cache_control": {"type": "ephemeral"}} if system_cached else {})}]
    last = {"type": "text", "text": "and now this", **({"cache_control": {"type": "ephemeral"}} if last_cached else {})}
    return {
        "model": "m",
        "max_tokens": 8,
        "system": system,
        "messages": [
            {"role": "user", "content": "first question " * 20},
            {"role": "assistant", "content": "first answer " * 20},
            {"role": "user", "content": [last]},
        ],
    }


def share(body: dict[str, Any]) -> float:
    return cached_prefix_share(body, len(orjson.dumps(body)))


def test_no_breakpoint_caches_nothing() -> None:
    assert share(request()) == 0.0


def test_a_breakpoint_on_the_last_block_covers_nearly_all() -> None:
    assert share(request(last_cached=True)) > 0.95


def test_a_system_breakpoint_covers_the_system_prompt_only() -> None:
    body = request(system_cached=True)
    after = len(orjson.dumps(body["messages"]))
    assert share(body) == pytest.approx(1 - after / len(orjson.dumps(body)), abs=0.02)


@given(prompt=st.integers(0, 200_000), read=st.integers(0, 300_000), fraction=st.floats(0, 1))
def test_the_three_counts_add_up_to_the_prompt(prompt: int, read: int, fraction: float) -> None:
    uncached, creation, cached = split_prompt(prompt, read, fraction)
    assert min(uncached, creation, cached) >= 0
    assert uncached + creation + cached == prompt


def feed_usage(reframer: StreamReframer, prompt: int, cached: int) -> list[dict[str, Any]]:
    usage = {"prompt_tokens": prompt, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}}
    events = reframer.feed({"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": usage})
    events += reframer.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage})
    return events + reframer.finish()


def test_the_reframer_reports_creation_where_the_worker_read_less_than_the_breakpoint() -> None:
    reframer = StreamReframer(message_id="msg_1", model="m", input_tokens=1000, cache_share=0.9)
    events = feed_usage(reframer, prompt=1000, cached=600)
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    delta = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert delta["cache_read_input_tokens"] == 600
    assert delta["cache_creation_input_tokens"] == 300  # 900 before the breakpoint, 600 of it read
    assert delta["input_tokens"] == 100
    for usage in (start, delta):
        assert usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"] == 1000


def test_a_second_turn_that_hits_the_cache_creates_only_what_is_new() -> None:
    reframer = StreamReframer(message_id="msg_1", model="m", input_tokens=1200, cache_share=0.99)
    delta = next(e for e in feed_usage(reframer, prompt=1200, cached=1188) if e["type"] == "message_delta")["usage"]
    assert (delta["cache_read_input_tokens"], delta["cache_creation_input_tokens"]) == (1188, 0)
    assert delta["input_tokens"] == 12
