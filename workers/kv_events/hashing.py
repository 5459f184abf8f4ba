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
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

__all__ = ["ALGORITHMS", "BlockHasher", "DEFAULT_SEED", "published"]

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

    def keys(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """The published hashes of a plain-text prompt's full blocks."""
        return [published(d) for d in self.chain(None, token_ids, block_size)]
