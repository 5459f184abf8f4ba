"""The streamed consumer's text fast path (StreamReframer.text_frame, sse.text_delta_frame) gives
the bytes and leaves the state that the general path (feed, then encode_event) gives, and takes
only the chunks it can."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from messages_api.reframe import StreamReframer
from messages_api.framing import encode_event, encode_events, text_delta_frame


def reframer() -> StreamReframer:
    return StreamReframer(message_id="msg_1", model="m", input_tokens=3)


def chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"choices": [{"index": 0, "delta": delta if delta is not None else {}, "finish_reason": finish_reason}]}
    if usage is not None:
        out["usage"] = usage
    return out


def stream_both_ways(chunks: list[dict[str, Any]]) -> tuple[bytes, bytes, StreamReframer, StreamReframer]:
    """The whole stream's bytes through `feed` alone and through `text_frame` first, as the consumer does."""
    general, fast = reframer(), reframer()
    general_bytes = b"".join(encode_events(general.feed(c)) for c in chunks) + encode_events(general.finish())
    parts = []
    for c in chunks:
        frame = fast.text_frame(c)
        parts.append(frame if frame is not None else encode_events(fast.feed(c)))
    parts.append(encode_events(fast.finish()))
    return general_bytes, b"".join(parts), general, fast


@given(st.text(min_size=1), st.integers(min_value=0, max_value=10**6))
def test_the_template_is_encode_event_of_the_text_delta(text: str, index: int) -> None:
    event = {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}
    assert text_delta_frame(index, text) == encode_event(event)


@given(st.lists(st.text(min_size=0, max_size=8), min_size=1, max_size=20))
def test_a_text_stream_gives_the_same_bytes_and_usage_either_way(texts: list[str]) -> None:
    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": t}, usage={"prompt_tokens": 7, "completion_tokens": i + 1}) for i, t in enumerate(texts)]
    chunks.append(chunk({}, finish_reason="stop", usage={"prompt_tokens": 7, "completion_tokens": len(texts)}))
    general_bytes, fast_bytes, general, fast = stream_both_ways(chunks)
    assert fast_bytes == general_bytes
    assert (fast.input_tokens, fast.output_tokens) == (general.input_tokens, general.output_tokens)


def test_only_a_text_token_on_the_open_text_block_takes_the_fast_path() -> None:
    r = reframer()
    assert r.text_frame(chunk({"content": "hi"})) is None  # message_start and the block come first
    r.feed(chunk({"content": "hi"}))
    assert r.text_frame(chunk({"content": "there"})) is not None
    assert r.text_frame(chunk({"content": ""})) is None  # nothing to say: feed decides (it says nothing)
    assert r.text_frame(chunk({"content": "x"}, finish_reason="stop")) is None
    assert r.text_frame(chunk({"content": "x", "reasoning_content": "hmm"})) is None
    assert r.text_frame(chunk({"reasoning": "hmm"})) is None
    assert r.text_frame(chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]})) is None
    assert r.text_frame({"choices": [], "usage": {"prompt_tokens": 1}}) is None
    r.feed(chunk({"reasoning_content": "hmm"}))  # a thinking block is open now
    assert r.text_frame(chunk({"content": "x"})) is None
    r.finish()
    assert r.text_frame(chunk({"content": "x"})) is None


def test_mixed_streams_give_the_same_bytes_either_way() -> None:
    chunks = [
        chunk({"reasoning_content": "think"}),
        chunk({"content": "a"}),
        chunk({"content": "b"}),
        chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({"content": "c"}),
        chunk({"content": "d"}, usage={"prompt_tokens": 5, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}),
        chunk({}, finish_reason="stop"),
    ]
    general_bytes, fast_bytes, _, _ = stream_both_ways(chunks)
    assert fast_bytes == general_bytes
