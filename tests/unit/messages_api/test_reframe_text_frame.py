"""The streamed consumer's text fast path (StreamReframer.text_frame, sse.text_delta_frame) gives
the bytes and leaves the state that the general path (feed, then encode_event) gives, and takes
only the chunks it can."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from messages_api.framing import encode_event, encode_events, text_delta_frame
from messages_api.reframe import CHARS_PER_TOKEN, LONG_PIECE_ALLOWANCE, OutputLimitReached, StreamReframer


def reframer(max_tokens: int | None = None) -> StreamReframer:
    return StreamReframer(message_id="msg_1", model="m", input_tokens=3, max_tokens=max_tokens)


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


def test_a_long_text_piece_is_left_to_feed_which_counts_it() -> None:
    r = reframer()
    r.feed(chunk({"content": "hi"}))
    assert r.text_frame(chunk({"content": "x" * CHARS_PER_TOKEN})) is not None
    assert r.text_frame(chunk({"content": "x" * (CHARS_PER_TOKEN + 1)})) is None
    assert r.relayed_tokens == 2


def limited_both_ways(chunks: list[dict[str, Any]], max_tokens: int) -> tuple[bytes, bytes, StreamReframer, StreamReframer]:
    """`stream_both_ways`, each way stopping where the reframer stops the relay."""
    general, fast = reframer(max_tokens), reframer(max_tokens)
    general_parts, fast_parts = [], []
    for c in chunks:
        try:
            general_parts.append(encode_events(general.feed(c)))
        except OutputLimitReached:
            break
    for c in chunks:
        try:
            frame = fast.text_frame(c)
            fast_parts.append(frame if frame is not None else encode_events(fast.feed(c)))
        except OutputLimitReached:
            break
    general_parts.append(encode_events(general.finish()))
    fast_parts.append(encode_events(fast.finish()))
    return b"".join(general_parts), b"".join(fast_parts), general, fast


def counted_relay(texts: list[str], max_tokens: int) -> tuple[str, int, bool]:
    """What the reframer's count relays of these pieces (its module's rule, stated plainly): the
    text, the count, and whether the limit cut the stream."""
    relayed, pieces, long_chars = "", 0, 0
    limit = max_tokens * CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE

    def count() -> int:
        return max(pieces, -(-(long_chars - LONG_PIECE_ALLOWANCE) // CHARS_PER_TOKEN))

    for text in filter(None, texts):
        if count() >= max_tokens:
            return relayed, count(), True
        pieces += 1
        if len(text) > CHARS_PER_TOKEN:
            room = limit - long_chars
            if len(text) > room:  # cut where the count reaches the limit
                long_chars = limit
                return relayed + text[:room], count(), True
            long_chars += len(text)
        relayed += text
    return relayed, count(), False


@given(
    st.lists(st.text(min_size=0, max_size=40) | st.text(min_size=200, max_size=400), min_size=1, max_size=30),
    st.integers(min_value=1, max_value=12),
)
def test_the_limit_and_the_count_are_the_same_either_way(texts: list[str], max_tokens: int) -> None:
    chunks = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": t}) for t in texts]
    chunks.append(chunk({}, finish_reason="stop"))
    general_bytes, fast_bytes, general, fast = limited_both_ways(chunks, max_tokens)
    assert fast_bytes == general_bytes
    assert fast.relayed_tokens == general.relayed_tokens == fast.output_tokens <= max_tokens
    text, count, cut = counted_relay(texts, max_tokens)
    assert relayed_text(fast_bytes) == text
    assert fast.relayed_tokens == count
    assert (b'"stop_reason":"max_tokens"' in fast_bytes) == cut


def relayed_text(frames: bytes) -> str:
    events = [orjson.loads(line[6:]) for line in frames.split(b"\n") if line.startswith(b"data: ")]
    return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")


def test_the_consumers_frames_of_a_held_read_leave_in_one_write() -> None:
    # messages_api.consumers.FrameWriter: a chunk's frames written at once, but between hold() and
    # release() (a worker read that brought several chunks) gathered into one write; the bytes
    # are those of one write per chunk.
    from types import SimpleNamespace

    from messages_api.consumers import FrameWriter

    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "a"}), chunk({"content": "b"}),
              chunk({"content": "c"}), chunk({"content": "d"})]
    expected, _, _, _ = stream_both_ways(chunks)
    writes: list[bytes] = []
    heartbeat = SimpleNamespace(sends=0)
    heartbeat.sent = lambda: setattr(heartbeat, "sends", heartbeat.sends + 1)
    r = reframer()
    frames = FrameWriter(r, writes.append, heartbeat)  # type: ignore[arg-type]
    frames.hold()
    for c in chunks[:3]:
        frames.write_chunk(c)
    assert writes == []
    frames.release()
    assert len(writes) == 1
    frames.write_chunk(chunks[3])  # not held: written at once
    assert len(writes) == 2
    frames.hold()
    frames.release()  # nothing gathered: nothing written
    frames.hold()
    frames.write_chunk(chunks[4])
    frames.release()
    assert len(writes) == 3 and heartbeat.sends == 3
    assert b"".join(writes) + encode_events(r.finish()) == expected
