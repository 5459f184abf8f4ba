"""A simulated worker's prefix (KV) cache: which prompt prefixes it could reuse without prefill.

Engines with automatic prefix caching (vLLM, SGLang, TensorRT-LLM's KV cache reuse) keep the KV
of a prompt in fixed-size blocks, each keyed by a hash chained over every token before it, so a
block can only be reused after all blocks before it matched. Full blocks only: the partial tail
block of a prompt is never shared. Eviction is least recently used; a prompt's blocks are touched
last-block-first, so that under pressure a conversation loses its tail before its shared head
(vLLM frees a request's blocks in reverse order for the same reason).

A request's `cache_salt` is mixed into its first block's hash, as vLLM does (and TensorRT-LLM into
the root of its block chain): the same prompt under two salts shares no block.

The cache also counts what it saved, and keeps a bounded log of stored/removed block hashes in
the shape of the engines' KV-event publishers, so a router can follow it (`GET /sim/kv_events`).
Given vLLM's hash settings (`hasher`), its block hashes are vLLM's (`workers.kv_events.hashing`,
the salt as the first block's extra key, as vLLM's `cache_salt`), and every change is also handed
to `publish` as vLLM's events (`BlockStored` with the blocks' tokens and parent, `BlockRemoved`,
`AllBlocksCleared`): what `workers.sim.kv_publisher` sends on vLLM's wire.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored, Event
from workers.kv_events.hashing import BlockHasher, published

# The KV-event log keeps this many events; a reader that fell further behind is told so.
EVENT_LOG_LIMIT = 10000


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`: block i's hash covers blocks 0..i (and
    the `salt`, through block 0)."""
    try:
        data = array("q", token_ids).tobytes()
    except (OverflowError, TypeError):
        return []  # not token ids a model could hold: nothing to cache
    width = 8 * block_tokens
    blake2b = hashlib.blake2b
    hashes: list[int] = []
    previous = b"" if not salt else blake2b(b"cache_salt:" + salt.encode(), digest_size=8).digest()
    for start in range(0, len(data) - width + 1, width):
        previous = blake2b(previous + data[start : start + width], digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return hashes


@dataclass(frozen=True, slots=True)
class KvEvent:
    seq: int
    kind: str  # "stored" or "removed"
    block_hashes: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.kind, "block_hashes": list(self.block_hashes)}


class PrefixCache:
    """KV blocks of one worker. `capacity_blocks` 0 disables caching (every lookup misses)."""

    def __init__(
        self, block_tokens: int, capacity_blocks: int, hasher: BlockHasher | None = None, publish: Callable[[list[Event]], None] | None = None
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must not be negative")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self.hasher = hasher
        self.publish = publish
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._events: deque[KvEvent] = deque(maxlen=EVENT_LOG_LIMIT)
        self._seq = 0
        self.computed_tokens = 0  # prompt tokens prefilled here
        self.cached_tokens = 0  # prompt tokens reused from the cache instead

    @property
    def enabled(self) -> bool:
        return self.capacity_blocks > 0

    @property
    def blocks_held(self) -> int:
        return len(self._blocks)

    def hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        if not self.enabled:
            return []
        if self.hasher is not None:
            count = len(token_ids) // self.block_tokens
            extra = [(salt,) if salt and i == 0 else None for i in range(count)]
            return [published(d) for d in self.hasher.chain(None, token_ids, self.block_tokens, extra)]
        return block_hashes(token_ids, self.block_tokens, salt)

    def match(self, token_ids: Sequence[int], *, touch: bool = True, salt: str | None = None) -> int:
        """How many leading tokens of the prompt are cached (a multiple of the block size)."""
        return self.match_blocks(self.hashes(token_ids, salt), touch=touch)

    def match_blocks(self, hashes: list[int], *, touch: bool = True) -> int:
        """`match` for a prompt's block hashes (`hashes()`), computed once per request."""
        matched = 0
        for block in hashes:
            if block not in self._blocks:
                break
            matched += 1
        if touch:
            self._touch(hashes[:matched])
        return matched * self.block_tokens

    def store(self, token_ids: Sequence[int], salt: str | None = None) -> None:
        """The prompt's KV is now held here: add its full blocks, evicting the least recent."""
        self.store_blocks(self.hashes(token_ids, salt), token_ids, salt)

    def store_blocks(self, hashes: list[int], token_ids: Sequence[int] = (), salt: str | None = None) -> None:
        """`store` for a prompt's block hashes (and its tokens, for the events)."""
        held = self._blocks
        fresh = [i for i, h in enumerate(hashes) if h not in held]
        self._touch(hashes)
        if fresh:
            self._log("stored", [hashes[i] for i in fresh])
        evicted: list[int] = []
        while len(held) > self.capacity_blocks:
            evicted.append(held.popitem(last=False)[0])
        if evicted:
            self._log("removed", evicted)
        if self.publish is not None and (fresh or evicted):
            events: list[Event] = self._stored_events(hashes, fresh, token_ids, salt) if fresh else []
            if evicted:
                events.append(BlockRemoved(tuple(evicted), "GPU"))
            self.publish(events)

    def _stored_events(self, hashes: list[int], fresh: list[int], token_ids: Sequence[int], salt: str | None) -> list[Event]:
        """One `BlockStored` per run of consecutive new blocks, as vLLM publishes them."""
        size = self.block_tokens
        events: list[Event] = []
        runs: list[list[int]] = []
        for i in fresh:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            extra = tuple((salt,) if salt and i == 0 else None for i in run)
            events.append(BlockStored(
                tuple(hashes[first : last + 1]), hashes[first - 1] if first else None, tuple(token_ids[first * size : (last + 1) * size]),
                size, extra, "GPU",
            ))  # fmt: skip
        return events

    def account(self, prompt_tokens: int, cached: int) -> None:
        """Count one prefill of `prompt_tokens` of which `cached` came from the cache."""
        self.cached_tokens += cached
        self.computed_tokens += prompt_tokens - cached

    def clear(self, *, restart: bool = False) -> None:
        """Drop every block: a prefix-cache reset (`AllBlocksCleared`), or with `restart` the
        engine's restart (nothing is published: the publisher starts over instead)."""
        if self._blocks:
            self._log("removed", list(self._blocks))
            self._blocks.clear()
        if self.publish is not None and not restart:
            self.publish([AllBlocksCleared()])

    def _touch(self, hashes: list[int]) -> None:
        # Last block first: the prompt's head ends up most recent and is evicted last.
        blocks = self._blocks
        for block in reversed(hashes):
            blocks[block] = None
            blocks.move_to_end(block)

    def _log(self, kind: str, hashes: list[int]) -> None:
        self._seq += 1
        self._events.append(KvEvent(self._seq, kind, tuple(hashes)))

    def events_after(self, seq: int) -> dict[str, Any]:
        """Events with a sequence number above `seq`; `lost` says the log no longer reaches back
        that far (the reader should start over from a full snapshot)."""
        oldest = self._events[0].seq if self._events else self._seq + 1
        return {
            "events": [e.as_json() for e in self._events if e.seq > seq],
            "last_seq": self._seq,
            "lost": seq + 1 < oldest and seq < self._seq,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "block_tokens": self.block_tokens,
            "capacity_blocks": self.capacity_blocks,
            "blocks_held": self.blocks_held,
            "computed_tokens": self.computed_tokens,
            "cached_tokens": self.cached_tokens,
            "last_seq": self._seq,
        }
