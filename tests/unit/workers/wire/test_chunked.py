"""workers.wire.chunked: the incremental chunked-coding decoder that relays a worker's stream."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.chunked import chunked  # the encoder, independent of the decoder tested here
from workers.wire.chunked import MAX_SIZE_LINE_BYTES, MAX_TRAILER_BYTES, ChunkedDecoder, ChunkedFramingError


def decode_in_pieces(wire: bytes, cuts: list[int]) -> tuple[bytes, ChunkedDecoder]:
    decoder = ChunkedDecoder()
    out = b""
    start = 0
    for cut in sorted(set(cuts)) + [len(wire)]:
        out += decoder.feed(wire[start:cut])
        start = cut
    return out, decoder


@settings(max_examples=500, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=0, max_size=300), max_size=12),
    extension=st.sampled_from([b"", b";name=value", b" ;x", b"\t"]),
    trailer=st.sampled_from([b"", b"x-usage: 1\r\n", b"a: 1\r\nb: 2\r\n"]),
    extra=st.binary(max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=30),
)
def test_any_split_of_any_chunked_body_decodes_to_its_payload(
    chunks: list[bytes], extension: bytes, trailer: bytes, extra: bytes, cuts: list[int]
) -> None:
    wire = chunked(chunks, extension=extension, trailer=trailer) + extra
    out, decoder = decode_in_pieces(wire, [c % (len(wire) + 1) for c in cuts])
    assert out == b"".join(chunks)
    assert decoder.done
    assert decoder.leftover == extra


def test_a_read_inside_one_chunk_is_handed_over_as_it_is() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"a\r\nhello") == b"hello"
    piece = b"worl"
    assert decoder.feed(piece) is piece  # no copy on the common path
    assert decoder.feed(b"d\r\n0\r\n\r\n") == b"d" and decoder.done


def test_nothing_is_held_back_but_framing() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5") == b""
    assert decoder.feed(b"\r\nab") == b"ab"  # part of a chunk goes on at once
    assert not decoder.done


@pytest.mark.parametrize(
    "wire",
    [
        b"g\r\n",  # not hex
        b"\r\n",  # no size
        b"-1\r\n",
        b"+1\r\n",
        b"0x5\r\n",
        b"1_0\r\n",
        b"5\r\nhelloXX",  # data not followed by CRLF
        b"5\r\nhello\rX",
        b"5\r\nhello\n\n",
        b"1" * 16 + b"\r\n",  # an absurd size
        b"1" * (MAX_SIZE_LINE_BYTES + 1),  # a size line that never ends
        b"0\r\n" + b"x" * (MAX_TRAILER_BYTES + 1),
        b"0\r\n" + b"a: 1\r\n" * (MAX_TRAILER_BYTES // 6 + 1),  # many short trailer lines
    ],
)
def test_malformed_framing_is_refused(wire: bytes) -> None:
    with pytest.raises(ChunkedFramingError):
        ChunkedDecoder().feed(wire)


def test_malformed_framing_is_refused_however_it_is_split() -> None:
    decoder = ChunkedDecoder()
    decoder.feed(b"5\r\nhello\r")
    with pytest.raises(ChunkedFramingError):
        decoder.feed(b"X")
