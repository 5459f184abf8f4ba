"""Block hashes as vLLM computes them: the chain, the seed, the published 64 bits, both algorithms."""

from __future__ import annotations

import hashlib
import pickle
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.kv_events.hashing import DEFAULT_SEED, BlockHasher, TokenKeys, hasher_for, known_algorithm, published


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 256 ** struct.calcsize(fmt):
            return bytes([major << 5 | code]) + struct.pack(fmt, n)
    raise ValueError(n)


def _cbor(value: object) -> bytes:
    """Canonical CBOR of what vLLM hashes (None, ints, bytes, str, tuples), written out by hand
    from RFC 8949 so that the test does not check cbor2 against itself."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        return _cbor_head(3, len(value.encode())) + value.encode()
    assert isinstance(value, tuple)
    return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)


def test_none_hash_is_the_hash_of_vllms_default_seed() -> None:
    assert BlockHasher("sha256").none_hash == hashlib.sha256(pickle.dumps(DEFAULT_SEED, protocol=5)).digest()
    assert BlockHasher("sha256_cbor").none_hash == hashlib.sha256(_cbor("vllm-none-hash")).digest()
    assert BlockHasher("sha256", "0").none_hash == hashlib.sha256(pickle.dumps("0", protocol=5)).digest()


@given(st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=70), st.integers(min_value=1, max_value=16))
def test_cbor_chain_matches_a_hand_written_encoding(tokens: list[int], size: int) -> None:
    hasher = BlockHasher("sha256_cbor")
    expected, parent = [], hasher.none_hash
    for start in range(0, len(tokens) - size + 1, size):
        parent = hashlib.sha256(_cbor((parent, tuple(tokens[start : start + size]), None))).digest()
        expected.append(parent)
    assert hasher.chain(None, tokens, size) == expected
    assert len(expected) == len(tokens) // size  # the partial tail block is never hashed


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_a_chain_continues_from_its_parents_digest(algorithm: str) -> None:
    hasher = BlockHasher(algorithm)
    whole = hasher.chain(None, list(range(40)), 8)
    assert hasher.chain(whole[1], list(range(16, 40)), 8) == whole[2:]
    assert hasher.keys(list(range(40)), 8) == [published(d) for d in whole]
    assert BlockHasher(algorithm, "42").keys(list(range(40)), 8) != hasher.keys(list(range(40)), 8)


def test_published_is_the_low_64_bits_big_endian() -> None:
    assert published(bytes(24) + (2**64 - 3).to_bytes(8, "big")) == 2**64 - 3
    assert published(b"\x01" + bytes(31)) == 0


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher("xxhash")


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40), st.integers(min_value=1, max_value=8))
def test_token_keys_chain_over_each_block_from_its_parents_key(tokens: list[int], size: int) -> None:
    """The gateway's own keys: BLAKE2b-64 of the parent key (or the root) and the block's tokens as
    unsigned 32-bit little-endian, written out here; a prompt's later blocks chain from its earlier
    ones, so keying a suffix from its parent's key gives the same keys."""
    keys = TokenKeys().keys(tokens, size)
    expected, previous = [], b"gateway-kv-tokens"
    for start in range(0, len(tokens) - size + 1, size):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + size])
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        expected.append(int.from_bytes(previous, "little"))
    assert keys == expected
    if len(keys) >= 2:
        assert TokenKeys().keys(tokens[size:], size, keys[0]) == keys[1:]


def test_token_keys_refuse_what_is_not_a_token_id() -> None:
    with pytest.raises(struct.error):
        TokenKeys().keys([2**32, 0], 2)
    with pytest.raises(struct.error):
        TokenKeys().keys([-1, 0], 2)


def test_hasher_for_an_endpoints_algorithm() -> None:
    assert isinstance(hasher_for("tokens"), TokenKeys)
    hasher = hasher_for("sha256_cbor", "7")
    assert isinstance(hasher, BlockHasher) and hasher.algorithm == "sha256_cbor" and hasher.none_hash == BlockHasher("sha256_cbor", "7").none_hash
    assert known_algorithm("tokens") and known_algorithm("sha256") and not known_algorithm("md5") and not known_algorithm("")
