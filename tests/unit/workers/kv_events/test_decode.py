"""The KV-event decoder reads both layouts the engines publish, and rejects what is not a batch."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.kv_events.decode import (
    AllBlocksCleared,
    BadEvents,
    BlockRemoved,
    BlockStored,
    block_key,
    decode_batch,
    encode_batch,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    size = draw(st.integers(min_value=1, max_value=8))
    hashes = tuple(draw(st.lists(U64, min_size=1, max_size=4)))
    tokens = tuple(draw(st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=size * len(hashes), max_size=size * len(hashes))))
    parent = draw(st.none() | U64)
    return BlockStored(hashes, parent, tokens, size, (None,) * len(hashes), "GPU", 0, None)


EVENTS = st.lists(
    st.one_of(stored(), st.builds(BlockRemoved, st.lists(U64, max_size=4).map(tuple), st.just("GPU")), st.just(AllBlocksCleared())),
    max_size=6,
)


@given(EVENTS, st.booleans(), st.integers(min_value=0, max_value=7))
def test_both_layouts_decode_to_the_same_events(events: list[BlockStored | BlockRemoved | AllBlocksCleared], maps: bool, rank: int) -> None:
    batch = decode_batch(encode_batch(12.5, events, rank, tagged_maps=maps))
    assert batch.events == tuple(events)
    assert batch.dp_rank == rank and batch.ts == 12.5 and batch.skipped == 0


def test_the_old_positional_layout_without_later_fields() -> None:
    # SGLang / vLLM ≤0.9: [tag, hashes, parent, tokens, block_size, lora_id], batch [ts, events].
    payload = msgpack.packb([1.0, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None], ["BlockRemoved", [7]], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.events == (BlockStored((7, 8), None, (1, 2, 3, 4), 2), BlockRemoved((7,)), AllBlocksCleared())
    assert batch.dp_rank == 0


def test_signed_and_digest_hashes_become_unsigned_64_bit_keys() -> None:
    assert block_key(-1) == 2**64 - 1
    assert block_key(b"\x00" * 24 + (5).to_bytes(8, "big")) == 5
    payload = msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [-2, b"\x01" * 32]}], 0], use_bin_type=True)
    assert decode_batch(payload).events == (BlockRemoved((2**64 - 2, int.from_bytes(b"\x01" * 8, "big"))),)


def test_unknown_event_types_are_skipped_and_counted() -> None:
    payload = msgpack.packb([0.0, [{"type": "updated", "x": 1}, {"type": "AllBlocksCleared"}], 0])
    batch = decode_batch(payload)
    assert batch.events == (AllBlocksCleared(),) and batch.skipped == 1


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",
        msgpack.packb({"x": 1}),
        msgpack.packb(["ts", [], 0]),
        msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 4}], 0]),
        msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"], "block_size": 1}], 0]),
        msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [True]}], 0]),
        msgpack.packb([0.0, [5], 0]),
        msgpack.packb([0.0, [], -1]),
    ],
)
def test_what_is_not_a_batch_is_refused(raw: bytes) -> None:
    with pytest.raises(BadEvents):
        decode_batch(raw)


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_bad_events(raw: bytes) -> None:
    try:
        decode_batch(raw)
    except BadEvents:
        pass
