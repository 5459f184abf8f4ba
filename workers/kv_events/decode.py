"""The engines' KV-cache event batches, decoded from their msgpack payloads into plain values.

One decoder for every layout seen in the wild (docs/engines.md, reference kv_events.md §1.2):

- the batch is `[ts, events, data_parallel_rank]` (vLLM since ≈0.9.1, SGLang, TensorRT-LLM's push
  form) or `[ts, events]` (before the rank was added); a map with those names is accepted too;
- an event is a tagged positional array, `["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]` (vLLM before its
  map encoding, SGLang), or a map with a `"type"` key (vLLM since PR #42892). Fields added later
  are optional in both; unknown fields are ignored;
- a block hash is an unsigned 64-bit integer (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`),
  a signed one (SGLang, TensorRT-LLM: the first 8 bytes of a digest), or the raw digest as bytes.
  Each becomes the unsigned 64-bit integer `block_key` makes of it, the form the index keys on.

Events of other types (TensorRT-LLM's `updated`, future ones) are skipped and counted
(`EventBatch.skipped`). A payload that is not one of these shapes raises `BadEvents`: a worker is
outside input, so nothing here trusts a length or a type it did not check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared", "BadEvents", "block_key", "BlockRemoved", "BlockStored", "decode_batch", "encode_batch", "Event", "EventBatch",
]

_U64 = (1 << 64) - 1

#: Fields of the positional layout, after the tag, in vLLM's order (SGLang's is its first five/six).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class BadEvents(ValueError):
    """Raised when a payload is not an event batch of a known layout (the message says which part)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly entered into the engine's prefix cache, in chain order: `block_hashes[0]`'s
    parent is `parent`, each next block's parent is the one before it."""

    block_hashes: tuple[int, ...]
    #: The first block's parent (None: the first block of a prompt).
    parent: int | None
    #: The tokens of all the blocks, `block_size` per block.
    token_ids: tuple[int, ...]
    block_size: int
    #: Per block, what besides the tokens went into its hash (LoRA, multimodal items, cache salt),
    #: as the engine publishes them; None when the event does not say (and for plain text).
    extra_keys: tuple[Any, ...] | None = None
    medium: str | None = None
    group_idx: int = 0
    lora: str | None = None

    @property
    def plain(self) -> bool:
        """Only tokens went into these blocks' hashes (what a subscriber can recompute)."""
        return self.lora is None and (self.extra_keys is None or all(k is None for k in self.extra_keys))


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the engine's prefix cache."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset: it holds nothing now."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int = 0
    #: Events of a type this decoder does not know, left out of `events`.
    skipped: int = 0


def block_key(value: Any) -> int:
    """A block hash as published, as the unsigned 64-bit integer the index keys on: an integer's
    low 64 bits (a signed one wraps), a digest's low 8 bytes read big-endian (what vLLM publishes
    as the integer form of the same digest)."""
    if isinstance(value, bool):
        raise BadEvents("a block hash is a boolean")
    if isinstance(value, int):
        return value & _U64
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise BadEvents(f"a block hash is a {type(value).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one published payload (the third frame of a message, or of a replayed one)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise BadEvents(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank", 0)
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else 0
    else:
        raise BadEvents("the batch is neither [ts, events, rank] nor a map")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise BadEvents("the batch's ts is not a number")
    if not isinstance(events, list):
        raise BadEvents("the batch's events are not a list")
    if rank is None:
        rank = 0
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise BadEvents("the batch's data_parallel_rank is not a non-negative integer")
    decoded: list[Event] = []
    skipped = 0
    for raw_event in events:
        event = _event(raw_event)
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return EventBatch(float(ts), tuple(decoded), rank, skipped)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise BadEvents("an event is neither a tagged array nor a map")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")), _text(fields.get("medium")), _int(fields.get("group_idx"), 0))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(kind, str):
        raise BadEvents("an event has no type")
    return None


def _stored(fields: dict[Any, Any]) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"))
    parent_raw = fields.get("parent_block_hash")
    parent = None if parent_raw is None else block_key(parent_raw)
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadEvents("a BlockStored's token_ids are not a list of integers")
    size = _int(fields.get("block_size"), None)
    if size is None or size < 1:
        raise BadEvents("a BlockStored's block_size is not a positive integer")
    if len(tokens) != size * len(hashes):
        raise BadEvents(f"a BlockStored carries {len(tokens)} tokens for {len(hashes)} blocks of {size}")
    extra = fields.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise BadEvents("a BlockStored's extra_keys are not one per block")
    lora = fields.get("lora_name")
    if lora is None and fields.get("lora_id") is not None:
        lora = str(fields.get("lora_id"))
    return BlockStored(
        hashes, parent, tuple(tokens), size, None if extra is None else tuple(_frozen(k) for k in extra),
        _text(fields.get("medium")), _int(fields.get("group_idx"), 0), None if lora is None else str(lora),
    )


def _hashes(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise BadEvents("block_hashes is not a list")
    return tuple(block_key(h) for h in raw)


def _int(raw: Any, default: int | None) -> Any:
    if raw is None:
        return default
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise BadEvents(f"an integer field is a {type(raw).__name__}")
    return raw


def _text(raw: Any) -> str | None:
    return raw if isinstance(raw, str) else None


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def encode_batch(ts: float, events: Sequence[Event], dp_rank: int = 0, *, tagged_maps: bool = True) -> bytes:
    """The payload an engine publishes for `events`, in vLLM's map layout (`tagged_maps`) or the
    positional one: what the simulated worker publishes, and what tests feed the decoder."""
    out: list[Any] = []
    for event in events:
        if isinstance(event, BlockStored):
            fields: dict[str, Any] = {
                "block_hashes": list(event.block_hashes), "parent_block_hash": event.parent, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": event.lora,
                "extra_keys": None if event.extra_keys is None else list(event.extra_keys), "group_idx": event.group_idx,
            }
            names: tuple[str, ...] = _STORED_FIELDS
            kind = "BlockStored"
        elif isinstance(event, BlockRemoved):
            fields = {"block_hashes": list(event.block_hashes), "medium": event.medium, "group_idx": event.group_idx}
            names, kind = _REMOVED_FIELDS, "BlockRemoved"
        else:
            fields, names, kind = {}, (), "AllBlocksCleared"
        out.append({"type": kind, **fields} if tagged_maps else [kind, *(fields[n] for n in names)])
    packed: bytes = msgpack.packb([ts, out, dp_rank], use_bin_type=True)
    return packed
