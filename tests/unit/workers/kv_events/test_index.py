"""One endpoint's block index: stores and removals, the leading-block count, the seq / replay /
reset state machine, and the hash check that puts an endpoint on the approximate index."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from workers.kv_events.hashing import BlockHasher, TokenKeys
from workers.kv_events.index import EndpointBlocks, Fallback, Replay

SIZE = 4
HASHER = BlockHasher("sha256")


def stored(tokens: list[int], parent_tokens: list[int] | None = None) -> BlockStored:
    """The event vLLM publishes for `tokens`' full blocks, after `parent_tokens`' blocks."""
    prefix = parent_tokens or []
    digests = HASHER.chain(None, prefix + tokens, SIZE)
    keys = HASHER.keys(prefix + tokens, SIZE)
    skip = len(prefix) // SIZE
    parent = keys[skip - 1] if skip else None
    assert digests
    return BlockStored(tuple(keys[skip:]), parent, tuple(tokens[: SIZE * (len(keys) - skip)]), SIZE, None, "GPU")


def batch(*events: object) -> EventBatch:
    return EventBatch(0.0, tuple(events))  # type: ignore[arg-type]


def fresh() -> EndpointBlocks:
    blocks = EndpointBlocks(1, HASHER, SIZE)
    blocks.joined()
    return blocks


def test_stores_and_removals_and_the_leading_count() -> None:
    blocks = fresh()
    prompt = list(range(16))
    keys = HASHER.keys(prompt, SIZE)
    assert blocks.on_live(0, batch(stored(prompt[:8])), 1.0) is None
    assert blocks.leading(keys) == 2
    blocks.on_live(1, batch(stored(prompt[8:], prompt[:8])), 2.0)
    assert blocks.leading(keys) == 4 and blocks.checked == 4 and blocks.trusted
    blocks.on_live(2, batch(BlockRemoved((keys[3], keys[2]))), 3.0)
    assert blocks.leading(keys) == 2 and blocks.size == 2
    blocks.on_live(3, batch(AllBlocksCleared()), 4.0)
    assert blocks.leading(keys) == 0 and blocks.applied_seq == 3


@given(st.integers(min_value=0, max_value=12), st.integers(min_value=0, max_value=12))
def test_leading_counts_a_held_prefix(held: int, length: int) -> None:
    blocks = EndpointBlocks(1, None, SIZE)
    keys = list(range(100, 100 + length))
    for key in keys[:held]:
        blocks._blocks[key] = -1
    assert blocks.leading(keys) == min(held, length)


def test_a_gap_asks_for_a_replay_from_the_next_seq() -> None:
    blocks = fresh()
    blocks.on_live(0, batch(stored(list(range(4)))), 1.0)
    assert blocks.on_live(3, batch(stored(list(range(50, 54)))), 2.0) == Replay(1)
    blocks.on_replayed(1, batch(), 2.0)
    blocks.on_replayed(2, batch(), 2.0)
    blocks.on_replayed(3, batch(stored(list(range(50, 54)))), 2.0)
    blocks.replay_done(2.0, answered=True)
    assert blocks.trusted and blocks.applied_seq == 3 and blocks.size == 2 and blocks.gaps == 1
    assert blocks.on_live(4, batch(), 3.0) is None and blocks.applied_seq == 4


def test_live_batches_a_replay_already_applied_are_skipped() -> None:
    blocks = fresh()
    blocks.on_live(0, batch(), 1.0)
    assert blocks.on_live(2, batch(), 2.0) == Replay(1)
    for seq in (1, 2, 3, 4):  # the ring had more than the live batch that asked
        blocks.on_replayed(seq, batch(stored([seq, seq, seq, seq])), 2.0)
    blocks.replay_done(2.0, answered=True)
    assert blocks.on_live(3, batch(stored([9, 9, 9, 9])), 3.0) is None and blocks.on_live(4, batch(), 3.0) is None
    assert blocks.size == 4 and blocks.applied_seq == 4 and blocks.trusted


def test_a_gap_the_replay_cannot_fill_falls_back_until_a_clear() -> None:
    blocks = fresh()
    blocks.on_live(0, batch(stored(list(range(4)))), 1.0)
    assert blocks.on_live(5, batch(stored(list(range(50, 54)))), 2.0) == Replay(1)
    blocks.on_replayed(4, batch(), 2.0)  # the ring no longer reaches back to 1
    blocks.replay_done(2.0, answered=True)
    assert blocks.fallback == Fallback.GAP and blocks.applied_seq == 5
    blocks.on_live(6, batch(AllBlocksCleared()), 3.0)
    assert blocks.trusted and blocks.size == 0


def test_an_unanswered_replay_falls_back_and_applies_the_live_batch() -> None:
    blocks = fresh()
    blocks.on_live(0, batch(), 1.0)
    assert blocks.on_live(2, batch(stored(list(range(4)))), 2.0) == Replay(1)
    blocks.replay_done(2.0, answered=False)
    assert blocks.fallback == Fallback.GAP and blocks.size == 1 and blocks.applied_seq == 2


def test_a_sequence_reset_clears_the_index() -> None:
    blocks = fresh()
    for seq in range(5):
        blocks.on_live(seq, batch(stored([seq * 10 + i for i in range(4)])), 1.0)
    assert blocks.size == 5
    assert blocks.on_live(0, batch(stored(list(range(90, 94)))), 2.0) is None  # the engine restarted
    assert blocks.size == 1 and blocks.resets == 1 and blocks.applied_seq == 0
    # A restart first heard at seq 1 (its seq 0 was missed): cleared, and replayed from 0.
    assert blocks.on_live(1, batch(stored(list(range(60, 64)))), 3.0) is None
    assert blocks.on_live(1, batch(), 4.0) == Replay(0)
    assert blocks.size == 0 and blocks.resets == 2
    blocks.on_replayed(0, batch(stored(list(range(70, 74)))), 4.0)
    blocks.on_replayed(1, batch(), 4.0)
    blocks.replay_done(4.0, answered=True)
    assert blocks.size == 1 and blocks.trusted and blocks.applied_seq == 1


def test_a_late_subscriber_starts_from_what_it_hears() -> None:
    blocks = fresh()
    assert blocks.on_live(41, batch(stored(list(range(4)))), 1.0) is None
    assert blocks.trusted and blocks.applied_seq == 41


def test_a_hash_that_does_not_match_falls_back() -> None:
    blocks = fresh()
    good = stored(list(range(8)))
    blocks.on_live(0, batch(good), 1.0)
    assert blocks.trusted
    # Published under other settings (here: another seed) than the endpoint's.
    other = BlockHasher("sha256", "7")
    keys = other.keys(list(range(100, 108)), SIZE)
    blocks.on_live(1, batch(BlockStored(tuple(keys), None, tuple(range(100, 108)), SIZE)), 2.0)
    assert blocks.fallback == Fallback.MISMATCH
    blocks.on_live(2, batch(AllBlocksCleared()), 3.0)
    assert blocks.fallback == Fallback.MISMATCH  # wrong settings do not heal


def test_a_child_is_checked_from_its_parents_digest_and_unknown_parents_are_not() -> None:
    blocks = fresh()
    prompt = list(range(12))
    blocks.on_live(0, batch(stored(prompt[:4])), 1.0)
    blocks.on_live(1, batch(stored(prompt[4:], prompt[:4])), 1.0)
    assert blocks.checked == 3 and blocks.unchecked == 0
    orphan = stored(list(range(50, 54)), list(range(40, 44)))
    blocks.on_live(2, batch(orphan), 1.0)
    assert blocks.unchecked == 1 and blocks.trusted


def test_the_index_is_bounded() -> None:
    blocks = EndpointBlocks(1, HASHER, SIZE, max_blocks=3, digests_kept=2)
    blocks.joined()
    blocks.on_live(0, batch(stored(list(range(20)))), 1.0)
    assert blocks.size == 3 and len(blocks._digests) == 2


def test_silence_falls_back_until_the_next_batch() -> None:
    blocks = fresh()
    blocks.on_live(0, batch(), 1.0)
    blocks.mark_silent("quiet", since=0.5)  # a batch came after the request: not silent
    assert blocks.trusted
    blocks.mark_silent("quiet", since=1.5)
    assert blocks.fallback == Fallback.SILENT
    blocks.on_live(1, batch(), 2.0)
    assert blocks.trusted


# --- followed by tokens (an engine whose hashes are not reproduced) --------------------------------

SEEDLESS = BlockHasher("sha256", "a seed the gateway does not know")  # as a vLLM with a random seed


def engine_stored(tokens: list[int], parent_tokens: list[int] | None = None) -> BlockStored:
    """What such an engine publishes: its own hashes, the tokens."""
    prefix = parent_tokens or []
    keys = SEEDLESS.keys(prefix + tokens, SIZE)
    skip = len(prefix) // SIZE
    return BlockStored(tuple(keys[skip:]), keys[skip - 1] if skip else None, tuple(tokens[: SIZE * (len(keys) - skip)]), SIZE, None, "GPU")


def by_tokens() -> EndpointBlocks:
    blocks = EndpointBlocks(1, TokenKeys(), SIZE)
    blocks.joined()
    return blocks


def test_followed_by_tokens_the_blocks_are_the_gateways_keys_of_their_tokens() -> None:
    blocks = by_tokens()
    prompt = list(range(16))
    keys = TokenKeys().keys(prompt, SIZE)  # what a learned prompt is scored by
    blocks.on_live(0, batch(engine_stored(prompt[:8])), 1.0)
    blocks.on_live(1, batch(engine_stored(prompt[8:], prompt[:8])), 2.0)  # a child: keyed from its parent's key
    assert blocks.leading(keys) == 4 and blocks.keyed == 4 and blocks.trusted
    assert blocks.checked == 0  # nothing to check: the engine's hashes are not reproduced
    engine = SEEDLESS.keys(prompt, SIZE)
    blocks.on_live(2, batch(BlockRemoved((engine[3], engine[2]))), 3.0)  # removed by the engine's hashes
    assert blocks.leading(keys) == 2 and blocks.size == 2 and blocks.removed == 2
    blocks.on_live(3, batch(AllBlocksCleared()), 4.0)
    assert blocks.leading(keys) == 0 and blocks._keys == {}


def test_followed_by_tokens_a_block_whose_parent_is_unknown_is_skipped() -> None:
    blocks = by_tokens()
    prompt = list(range(16))
    blocks.on_live(0, batch(engine_stored(prompt[8:], prompt[:8])), 1.0)  # its parent was stored before we joined
    assert blocks.size == 0 and blocks.unkeyed == 2 and blocks.trusted
    salted = BlockStored((1, 2), None, tuple(range(8)), SIZE, (("salt",), None), "GPU")
    blocks.on_live(1, batch(salted), 2.0)  # its key would need what the engine mixed in
    assert blocks.size == 0 and blocks.unkeyed == 4
    blocks.on_live(2, batch(BlockStored((1,), None, (-1, 0, 0, 0), SIZE, None, "GPU")), 3.0)  # not token ids
    assert blocks.size == 0 and blocks.unkeyed == 5 and blocks.trusted


def test_followed_by_tokens_a_wrong_block_size_or_token_count_falls_back() -> None:
    blocks = by_tokens()
    blocks.on_live(0, batch(BlockStored((1, 2), None, tuple(range(6)), SIZE, None, "GPU")), 1.0)
    assert blocks.fallback == Fallback.MISMATCH and "6 tokens" in blocks.detail
    other = by_tokens()
    other.on_live(0, batch(BlockStored((1,), None, tuple(range(8)), 8, None, "GPU")), 1.0)
    assert other.fallback == Fallback.MISMATCH and "block size is 8" in other.detail


def test_followed_by_tokens_both_maps_are_bounded() -> None:
    blocks = EndpointBlocks(1, TokenKeys(), SIZE, max_blocks=3)
    blocks.joined()
    prompt = list(range(40))
    blocks.on_live(0, batch(engine_stored(prompt)), 1.0)
    assert blocks.size == 3 and len(blocks._keys) == 3
