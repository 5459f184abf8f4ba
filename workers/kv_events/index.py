"""What one engine holds, as its KV-cache events tell it: the block index of one endpoint, and
the sequence state machine that says whether the index can be trusted.

    blocks = EndpointBlocks(endpoint_id, hasher, block_size=16)
    blocks.on_live(seq, batch)        -> Replay | None   a batch from the PUB socket
    blocks.on_replayed(seq, batch)                       a batch the replay socket sent back
    blocks.replay_done(asked_from)                       the replay ended: was the gap filled?
    blocks.leading(keys)              -> int             how many of a prompt's first blocks it holds
    blocks.trusted                                       False: route this endpoint on the approximate index

Sequence numbers (one counter per publisher, from 0; a restarted engine starts again at 0):
- the live stream is monotonic, so a live batch whose seq is not above the last live one means
  the publisher restarted: the index is cleared (and replayed from 0 if that batch is not seq 0);
- a live batch past the next expected one is a gap: the caller replays from the next expected seq
  (`Replay`), and live batches are applied only once they follow what was applied;
- a gap the replay does not fill (the engine's ring no longer reaches back) leaves blocks unknown
  and removals unheard: the endpoint is not trusted until the index is whole again, on
  `AllBlocksCleared` or a restart. The first connection is not a gap: an engine's blocks from
  before its ring's window are unknown, as with any late subscriber.

Checks (each puts the endpoint on the approximate index, counted and logged once by the caller):
- a stored block whose hash, recomputed from the tokens the event carries, differs from the one
  published (wrong block size, algorithm or seed in the endpoint's settings; `mismatch`);
- the unreplayable gap above (`gap`);
- events stopping while requests were sent (`silent`, set by `KvEvents.check_silence`); ended by
  the next batch in sequence.

Recomputing needs the parent's full 32-byte digest (`workers.kv_events.hashing`): a prompt's first
block always, and a block whose parent was recomputed here while its digest is still among the
last `digests_kept`. Blocks with LoRA or other extra keys, of another medium than the GPU's, or of
a non-zero KV-cache group are indexed unchecked (their hashing is not reproduced here).

Followed by tokens (`workers.kv_events.hashing.TokenKeys`: an engine whose hashes are not
reproduced), each stored block is keyed by the gateway's own chain over the event's tokens, from
its parent's key; the engine's hash maps to that key for its removal and for its children. A
block whose parent's key is unknown (stored before this subscriber joined, or forgotten) cannot be
keyed and is skipped (counted, as llm-d and Dynamo do). Nothing is checked.

Bounded: at most `max_blocks` blocks (a lost removal cannot grow it without end: the oldest go
first), `digests_kept` digests for the check; followed by tokens, as many engine hashes as blocks.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from workers.kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from workers.kv_events.hashing import BlockHasher, TokenKeys, published

__all__ = ["EndpointBlocks", "Fallback", "Profile", "Replay"]

#: An engine's hash settings: algorithm, seed ("" : vLLM's default), block size. Prompts learned
#: under one profile are scored on every endpoint of that profile.
Profile = tuple[str, str, int]


class Fallback:
    """Why an endpoint is not routed on its events (the values of `EndpointBlocks.fallback`)."""

    MISMATCH = "mismatch"
    GAP = "gap"
    SILENT = "silent"


@dataclass(frozen=True, slots=True)
class Replay:
    """Ask the engine's replay socket for every batch from `start_seq` on."""

    start_seq: int


class EndpointBlocks:
    """One endpoint's blocks and the state of its event stream (one per subscribed endpoint)."""

    def __init__(
        self,
        endpoint_id: int,
        hasher: BlockHasher | TokenKeys | None,
        block_size: int,
        *,
        max_blocks: int = 1_000_000,
        digests_kept: int = 65536,
    ) -> None:
        self.endpoint_id = endpoint_id
        self.hasher = hasher if isinstance(hasher, BlockHasher) else None
        # Followed by tokens: the gateway's keys, and the engine's hash -> key, oldest first.
        self._keyer = hasher if isinstance(hasher, TokenKeys) else None
        self._keys: dict[int, int] = {}
        #: Its hash settings, when the gateway can reproduce its hashes (None: it cannot, and no
        #: prompt is scored on its blocks).
        self.profile: Profile | None = None
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.digests_kept = digests_kept
        # Held blocks, hash -> parent hash (-1: a prompt's first block), oldest first.
        self._blocks: dict[int, int] = {}
        # Full digests of blocks recomputed here, for checking their children.
        self._digests: OrderedDict[int, bytes] = OrderedDict()
        #: The last seq applied (None: nothing yet), the last seq seen on the live stream.
        self.applied_seq: int | None = None
        self.live_seq: int | None = None
        #: Why the endpoint is routed on the approximate index ("" while its events are trusted).
        self.fallback = ""
        self.detail = ""
        #: Counts, for /metrics and the overview.
        self.batches = 0
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.checked = 0
        self.unchecked = 0
        self.resets = 0
        self.gaps = 0
        #: Followed by tokens: blocks keyed, and blocks skipped for a parent whose key is unknown.
        self.keyed = 0
        self.unkeyed = 0
        #: `time.monotonic()` of the last batch applied (0: none yet).
        self.last_event_at = 0.0
        # The live batch that asked for a replay, applied after it if the replay does not reach it.
        self._pending: tuple[int, EventBatch] | None = None
        self._joining = False

    # --- reading ------------------------------------------------------------------------------

    @property
    def trusted(self) -> bool:
        return not self.fallback

    @property
    def size(self) -> int:
        return len(self._blocks)

    def holds(self, key: int) -> bool:
        return key in self._blocks

    def leading(self, keys: Sequence[int]) -> int:
        """How many of `keys` (a prompt's block hashes, in order) the engine holds from the first
        on: a bisection, as an engine's blocks of one chain are prefix-closed (vLLM evicts a
        request's tail first, and a child is only cached after its parent), checked at the end."""
        blocks = self._blocks
        lo, hi = 0, len(keys)
        if hi == 0 or keys[0] not in blocks:
            return 0
        if keys[hi - 1] in blocks:
            return hi
        lo = 1  # keys[:lo] held, keys[hi - 1] not
        while lo < hi - 1:
            mid = (lo + hi) // 2
            if keys[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid
        return lo

    # --- the stream ---------------------------------------------------------------------------

    def on_live(self, seq: int, batch: EventBatch, now: float) -> Replay | None:
        """A batch from the live stream. Returns a replay to ask for when it does not follow what
        was applied (then `replay_done` once the replayed batches are in)."""
        if self.live_seq is not None and seq <= self.live_seq:
            # The publisher restarted: its cache restarted empty.
            self.resets += 1
            self._clear(healed=True)
        self.live_seq = seq
        if self.applied_seq is not None and seq <= self.applied_seq:
            return None  # already applied from a replay
        if self._joining:
            # The first batch after a first replay that found nothing: a late subscriber starts
            # from what it hears (an engine's earlier blocks are unknown to any late subscriber).
            self._joining = False
            self._apply(seq, batch, now)
            return None
        expected = 0 if self.applied_seq is None else self.applied_seq + 1
        if seq == expected:
            self._apply(seq, batch, now)
            return None
        self._pending = (seq, batch)
        self.gaps += 1
        return Replay(expected)

    def on_replayed(self, seq: int, batch: EventBatch, now: float) -> None:
        """A batch the replay socket sent back (they come in seq order)."""
        if self.applied_seq is not None and seq <= self.applied_seq:
            return
        expected = 0 if self.applied_seq is None else self.applied_seq + 1
        if seq != expected and not (self._joining and self.applied_seq is None):
            self._lost(f"the engine's replay starts at seq {seq}, after {expected}")
        self._joining = False
        self._apply(seq, batch, now)

    def joined(self) -> None:
        """The first replay after connecting is over (or there is no replay socket): whatever
        comes next live is where this subscriber starts."""
        self._joining = self.applied_seq is None

    def replay_done(self, now: float, *, answered: bool) -> None:
        """The replay asked for by `on_live` ended (`answered`: the engine sent its end marker).
        If it did not reach the live batch that asked for it, the missed events are lost."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        seq, batch = pending
        if self.applied_seq is not None and seq <= self.applied_seq:
            return
        self._lost("the engine could not replay the missed events" if answered else "the engine's replay socket did not answer")
        self._apply(seq, batch, now)

    def broken(self, detail: str) -> None:
        """A batch could not be decoded: what it said is lost."""
        self._lost(detail)

    def mark_silent(self, detail: str, *, since: float) -> None:
        """No batch came since `since` (when a request was sent here). Judged again here, as the
        subscriptions' thread may have applied one since the caller looked."""
        if not self.fallback and self.last_event_at < since:
            self.fallback, self.detail = Fallback.SILENT, detail

    def _lost(self, detail: str) -> None:
        if self.fallback != Fallback.MISMATCH:
            self.fallback, self.detail = Fallback.GAP, detail

    def _clear(self, *, healed: bool) -> None:
        self._blocks.clear()
        self._digests.clear()
        self._keys.clear()
        self.applied_seq = None
        if healed and self.fallback in (Fallback.GAP, Fallback.SILENT):
            self.fallback, self.detail = "", ""

    def _apply(self, seq: int, batch: EventBatch, now: float) -> None:
        self.applied_seq = seq
        self.batches += 1
        self.last_event_at = now
        if self.fallback == Fallback.SILENT:
            self.fallback, self.detail = "", ""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                if self._keyer is not None:
                    keys = self._keys
                    for engine_hash in event.block_hashes:
                        key = keys.pop(engine_hash, None)
                        self.removed += key is not None and self._blocks.pop(key, None) is not None
                    continue
                for key in event.block_hashes:
                    self.removed += self._blocks.pop(key, None) is not None
                    self._digests.pop(key, None)
            elif isinstance(event, AllBlocksCleared):
                self.cleared += 1
                applied = self.applied_seq
                self._clear(healed=True)
                self.applied_seq = applied

    def _store(self, event: BlockStored) -> None:
        if event.group_idx != 0 or (event.medium not in (None, "GPU")):
            return  # another KV group (sliding window, mamba) or an offload tier: not the prefix cache routed on
        if self._keyer is not None:
            self._store_by_tokens(event, self._keyer)
            return
        blocks = self._blocks
        parent = -1 if event.parent is None else event.parent
        for key in event.block_hashes:
            blocks.pop(key, None)
            blocks[key] = parent
            parent = key
        self.stored += len(event.block_hashes)
        while len(blocks) > self.max_blocks:
            oldest = next(iter(blocks))
            del blocks[oldest]
            self._digests.pop(oldest, None)
        self._check(event)

    def _store_by_tokens(self, event: BlockStored, keyer: TokenKeys) -> None:
        count = len(event.block_hashes)
        if event.block_size != self.block_size:
            self._mismatch(f"the engine's block size is {event.block_size}, the endpoint's setting {self.block_size}")
            return
        parent = None if event.parent is None else self._keys.get(event.parent)
        if not event.plain or (event.parent is not None and parent is None):
            # LoRA, multimodal or salted blocks (their keys would need what the engine mixed in), or
            # a parent stored before this subscriber joined: not keyed.
            self.unkeyed += count
            return
        try:
            keys = keyer.keys(event.token_ids, event.block_size, parent)
        except struct.error:
            self.unkeyed += count  # not token ids: the event is outside input
            return
        if len(keys) != count:
            self._mismatch(f"a stored event's {len(event.token_ids)} tokens are not {count} blocks of {event.block_size}")
            return
        blocks, engine_keys = self._blocks, self._keys
        previous = -1 if parent is None else parent
        for engine_hash, key in zip(event.block_hashes, keys, strict=True):
            engine_keys.pop(engine_hash, None)
            engine_keys[engine_hash] = key
            blocks.pop(key, None)
            blocks[key] = previous
            previous = key
        self.stored += count
        self.keyed += count
        while len(blocks) > self.max_blocks:
            del blocks[next(iter(blocks))]
        while len(engine_keys) > self.max_blocks:
            del engine_keys[next(iter(engine_keys))]

    def _check(self, event: BlockStored) -> None:
        hasher = self.hasher
        parent_digest = None if event.parent is None else self._digests.get(event.parent)
        if hasher is None or not event.plain or event.block_size != self.block_size or (event.parent is not None and parent_digest is None):
            if hasher is not None and event.block_size != self.block_size:
                self._mismatch(f"the engine's block size is {event.block_size}, the endpoint's setting {self.block_size}")
            self.unchecked += len(event.block_hashes)
            return
        digests = hasher.chain(parent_digest, event.token_ids, event.block_size)
        for key, digest in zip(event.block_hashes, digests, strict=True):
            if published(digest) != key:
                self._mismatch(f"block {key} hashes to {published(digest)} with {hasher.algorithm}")
                return
            self._digests[key] = digest
        self.checked += len(digests)
        while len(self._digests) > self.digests_kept:
            self._digests.popitem(last=False)

    def _mismatch(self, detail: str) -> None:
        self.fallback, self.detail = Fallback.MISMATCH, detail
