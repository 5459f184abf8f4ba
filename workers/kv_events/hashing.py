"""Block hashes as vLLM computes them, so that the gateway can check what an engine publishes and
compute the blocks of a prompt whose token ids it knows.

vLLM (`vllm/v1/core/kv_cache_utils.py`: `init_none_hash`, `hash_block_tokens`,
`get_request_block_hasher`; `vllm/utils/hashing.py`):

    NONE_HASH = H(seed)                        seed: PYTHONHASHSEED if set, else "vllm-none-hash"
    h_i       = H((h_{i-1}, tuple(block_i_token_ids), extra_keys_i))     h_{-1} = NONE_HASH
    published = int.from_bytes(h_i, "big") & (2**64 - 1)

with H chosen by `--prefix-caching-hash-algo`: `sha256` is SHA-256 of the pickle (highest
protocol) of the tuple, `sha256_cbor` SHA-256 of its canonical CBOR. The chain carries the full
32-byte digest; only the published value is cut to 64 bits. So a block's hash can be recomputed
from its tokens only when its parent's full digest is known: the first block of a prompt (parent
NONE_HASH), or a block whose parent was recomputed here. Only full blocks are hashed.

Engines older than vLLM PR #51875 (Aug 2026) seed NONE_HASH from 32 random bytes when
PYTHONHASHSEED is unset: their hashes cannot be reproduced, and the endpoint's setting must then
name the seed they were started with (docs/engines.md).

An engine whose hashes are not reproduced here (SGLang's and TensorRT-LLM's are their own and move
between releases; a vLLM with a random seed) is followed by its blocks' tokens instead
(`TokenKeys`, the endpoint's algorithm `tokens`, as llm-d and Dynamo do): the gateway keys each
block by its own chain over the tokens the event carries, and maps the engine's hashes to those
keys for its removals and its children. Nothing is checked then; what a prompt's blocks are is the
gateway's own computation on both sides.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

__all__ = ["ALGORITHMS", "BlockHasher", "DEFAULT_SEED", "hasher_for", "known_algorithm", "published", "TokenKeys", "TOKENS"]

#: vLLM's seed when PYTHONHASHSEED is unset and the algorithm is cryptographic (DEFAULT_NONE_HASH_SEED).
DEFAULT_SEED = "vllm-none-hash"


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


#: `--prefix-caching-hash-algo` values the gateway reproduces.
ALGORITHMS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}

_U64 = (1 << 64) - 1


def published(digest: bytes) -> int:
    """The integer vLLM publishes for a block digest: its low 64 bits."""
    return int.from_bytes(digest, "big") & _U64


class BlockHasher:
    """One engine's hash settings: its algorithm and seed."""

    __slots__ = ("algorithm", "none_hash", "_hash")

    def __init__(self, algorithm: str = "sha256", seed: str | None = None) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown hash algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
        self.algorithm = algorithm
        self._hash = ALGORITHMS[algorithm]
        #: The digest every prompt's first block chains from.
        self.none_hash = self._hash(DEFAULT_SEED if seed is None else seed)

    def chain(self, parent: bytes | None, token_ids: Sequence[int], block_size: int, extra_keys: Sequence[Any] | None = None) -> list[bytes]:
        """The full digests of the full blocks of `token_ids`, chained from `parent` (None: the
        prompt's start). `extra_keys`, when given, holds one entry per block (None for plain text)."""
        digests: list[bytes] = []
        previous = self.none_hash if parent is None else parent
        hash_ = self._hash
        for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
            extra = extra_keys[i] if extra_keys is not None else None
            previous = hash_((previous, tuple(token_ids[start : start + block_size]), extra))
            digests.append(previous)
        return digests

    def keys(self, token_ids: Sequence[int], block_size: int, extra_keys: Sequence[Any] | None = None) -> list[int]:
        """The published hashes of a prompt's full blocks (plain text: no `extra_keys`)."""
        return [published(d) for d in self.chain(None, token_ids, block_size, extra_keys)]


#: The endpoint algorithm that keys blocks by their tokens (`TokenKeys`) rather than reproducing
#: the engine's hashes.
TOKENS = "tokens"

_ROOT = b"gateway-kv-tokens"


class TokenKeys:
    """The gateway's own block keys: 64 bits of BLAKE2b over the parent's key and the block's
    token ids (unsigned 32-bit, little-endian), chained from a fixed root. Any engine whose events
    carry the tokens can be followed with them; the key of a block is the same whichever engine
    holds it, and whatever that engine's own hash is."""

    __slots__ = ()

    algorithm = TOKENS

    def keys(self, token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
        """The keys of the full blocks of `token_ids`, chained from the block keyed `parent` (None:
        the prompt's start). Token ids outside 0..2**32-1 raise `struct.error`."""
        keys: list[int] = []
        previous = _ROOT if parent is None else parent.to_bytes(8, "little")
        blake2b = hashlib.blake2b
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            previous = blake2b(previous + struct.pack(f"<{block_size}I", *token_ids[start : start + block_size]), digest_size=8).digest()
            keys.append(int.from_bytes(previous, "little"))
        return keys


def known_algorithm(algorithm: str) -> bool:
    """Whether the gateway can key blocks under `algorithm` (an engine's, or `tokens`)."""
    return algorithm in ALGORITHMS or algorithm == TOKENS


def hasher_for(algorithm: str, seed: str | None = None) -> BlockHasher | TokenKeys:
    """What computes a prompt's block keys under an endpoint's algorithm and seed."""
    return TokenKeys() if algorithm == TOKENS else BlockHasher(algorithm, seed)
