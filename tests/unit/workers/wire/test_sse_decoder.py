"""workers.wire.sse_decoder: the event stream decoder, without an event loop.

The property tests compare the decoder, fed a stream in any split, with a reference that reads
the whole stream at once; the cost tests show a line without a newline is refused in linear time.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.wire.sse_decoder import Event, SSEDecoder, SSELineTooLong

LIMIT = 8 * 1024 * 1024


def decode(*feeds: bytes, limit: int = LIMIT) -> list[Event]:
    decoder = SSEDecoder(limit)
    events = [event for feed in feeds for event in decoder.feed(feed)]
    return events + decoder.end()


def test_an_openai_stream_decodes_to_its_data_events() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    assert [event.data for event in decode(stream)] == ['{"a":1}', '{"b":2}', "[DONE]"]


def test_multi_line_data_is_joined_with_newlines() -> None:
    assert decode(b"data: one\ndata:two\ndata\n\n") == [Event(data="one\ntwo\n")]


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending_ends_a_line(end: bytes) -> None:
    stream = b"event: e" + end + b"data: x" + end + b"data: y" + end + end
    assert decode(stream) == [Event(data="x\ny", event="e")]


def test_a_crlf_split_across_feeds_is_one_line_ending() -> None:
    # "\r" then "\n": one line end, not a blank line in between that would dispatch early.
    assert decode(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == [Event(data="a\nb")]


def test_comments_unknown_fields_and_blank_events_are_skipped() -> None:
    stream = b": keep-alive\n\nfoo: bar\n\nevent: ping\n\ndata: x\n\n"
    # An event with no data is not dispatched, and its type does not leak into the next.
    assert decode(stream) == [Event(data="x")]


def test_id_and_retry_fields() -> None:
    events = decode(b"id: 7\nretry: 1500\ndata: a\n\nid: bad\0id\nretry: soon\ndata: b\n\n")
    assert events == [Event(data="a", id="7", retry=1500), Event(data="b", id="7", retry=1500)]


def test_one_leading_bom_is_dropped_even_when_split() -> None:
    assert decode(b"\xef\xbb", b"\xbfdata: x\n\n") == [Event(data="x")]
    # Only the stream's first BOM: a later one is part of the field name (an unknown field).
    assert decode(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n") == []


def test_only_one_space_after_the_colon_is_removed() -> None:
    assert decode(b"data:  two spaces\n\n") == [Event(data=" two spaces")]


def test_invalid_utf8_is_replaced_and_split_characters_survive() -> None:
    snowman = "☃".encode()
    assert decode(b"data: " + snowman[:1], snowman[1:] + b"\xff\n\n") == [Event(data="☃\ufffd")]


def test_at_the_end_a_complete_last_event_without_its_blank_line_is_kept() -> None:
    assert decode(b"data: [DONE]\n") == [Event(data="[DONE]")]
    assert decode(b"data: [DONE]") == []  # an unterminated line may have been cut


def test_a_line_longer_than_the_limit_is_refused() -> None:
    decoder = SSEDecoder(16)
    assert decoder.feed(b"data: 0123456789\n\n") == [Event(data="0123456789")]
    with pytest.raises(SSELineTooLong):
        decoder.feed(b"data: " + b"x" * 20)


def test_a_long_line_arriving_whole_with_its_newline_is_refused() -> None:
    with pytest.raises(SSELineTooLong):
        SSEDecoder(16).feed(b"data: " + b"x" * 20 + b"\n\n")


def test_an_event_of_many_short_lines_is_bounded_too() -> None:
    decoder = SSEDecoder(64)
    with pytest.raises(SSELineTooLong):
        for _ in range(100):
            decoder.feed(b"data: 0123456789\n")


def test_a_100_mb_line_without_a_newline_is_cut_at_the_limit_quickly() -> None:
    decoder = SSEDecoder(LIMIT)
    piece = b"x" * 65536
    fed = 0
    started = time.perf_counter()
    with pytest.raises(SSELineTooLong):
        while fed < 100 * 1024 * 1024:
            decoder.feed(piece)
            fed += len(piece)
    elapsed = time.perf_counter() - started
    assert fed <= LIMIT  # refused at the limit, not after buffering the whole line
    assert elapsed < 1.0, elapsed


def test_decoding_a_long_line_in_small_feeds_costs_linear_time() -> None:
    """32 MiB in 4 KiB feeds under a larger limit: rescanning the buffer on every feed (quadratic)
    would read ~64 GiB; resuming the search reads each byte once."""
    decoder = SSEDecoder(64 * 1024 * 1024)
    piece = b"y" * 4096
    started = time.perf_counter()
    decoder.feed(b"data: ")
    for _ in range(32 * 1024 * 1024 // len(piece)):
        decoder.feed(piece)
    events = decoder.feed(b"\n\n")
    elapsed = time.perf_counter() - started
    assert len(events) == 1 and len(events[0].data) == 32 * 1024 * 1024
    assert elapsed < 3.0, elapsed


# --- properties ----------------------------------------------------------------------------------

LINES = st.sampled_from(
    [b"data: x", b"data:{\"k\": 1}", b"data", b"data: \xe2\x98\x83", b"event: error", b"event:", b"id: 3",
     b"id", b"retry: 25", b"retry: x", b": comment", b":", b"", b"", b"", b"foo: bar", b"data:  spaced"]
)
ENDINGS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(st.tuples(LINES, ENDINGS), max_size=40))
    bom = draw(st.booleans())
    tail = draw(st.sampled_from([b"", b"data: cut"]))
    return (b"\xef\xbb\xbf" if bom else b"") + b"".join(line + end for line, end in lines) + tail


def reference(stream: bytes) -> list[Event]:
    """The spec's algorithm over the whole stream at once (with the documented end-of-stream
    leniency): normalise line ends, split, interpret."""
    if stream.startswith(b"\xef\xbb\xbf"):
        stream = stream[3:]
    text = stream.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    *lines, unterminated = text.split(b"\n")
    events: list[Event] = []
    data: list[bytes] = []
    event_type, last_id, retry = b"", "", None

    def dispatch() -> None:
        nonlocal data, event_type
        if data:
            events.append(Event(b"\n".join(data).decode("utf-8", "replace"), event_type.decode() or "message", last_id, retry))
        data, event_type = [], b""

    for line in lines:
        if not line:
            dispatch()
            continue
        if line.startswith(b":"):
            continue
        name, colon, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event_type = value
        elif name == b"id" and b"\0" not in value:
            last_id = value.decode()
        elif name == b"retry" and value.isdigit():
            retry = int(value)
    if not unterminated:
        dispatch()  # the end: a pending event whose last line was complete
    return events


@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0), max_size=12))
def test_any_split_of_a_stream_gives_the_events_of_the_whole(stream: bytes, cuts: list[int]) -> None:
    points = sorted({cut % (len(stream) + 1) for cut in cuts})
    feeds = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert decode(*feeds) == decode(stream) == reference(stream)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=300))
def test_hostile_bytes_decode_or_fail_cleanly_and_byte_at_a_time_equals_whole(data: bytes, limit: int) -> None:
    def run(*feeds: bytes) -> list[Event] | str:
        try:
            return decode(*feeds, limit=limit)
        except SSELineTooLong:
            return "too long"

    whole = run(data)
    one_by_one = run(*(data[i : i + 1] for i in range(len(data))))
    # Fed whole, a line is measured in the same bytes as fed byte by byte; both agree.
    assert whole == one_by_one
