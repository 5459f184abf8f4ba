"""Prompts learned by one gateway process, shared with the others through Redis (`REDIS_URL`).

    shared = SharedPrompts(keep)           # keep(profile, mark, keys): keep one learned elsewhere
    shared.publish(profile, mark, keys)    # one learned here (on the subscriptions' loop)
    await shared.follow()                  # on the subscriptions' loop, until cancelled

A conversation's prompt is learned by the process whose request carried it (`KvEvents.learn`: its
worker's first chunk gave the token ids). Its next turn may reach another process, which would
know nothing of it and route on its approximate index, so two processes would not agree. Each
learned prompt, once hashed, is therefore appended to one Redis stream
(`{REDIS_KEY_PREFIX}kv:learned`), and every process follows the stream and keeps what the others
learned as if it had learned it (`KvEvents._keep`).

No request waits on Redis: routing reads only the process's own store, which the stream fills in
the background. A prompt reaches the other processes a few milliseconds after its first chunk,
while its answer is still streaming; its next turn comes after the whole answer (and the
client's own work). A turn that arrives sooner is routed as before, on the approximate index.
Evictions need no sharing: every process follows every engine's events itself.

An entry: the learning process (`GATEWAY_INSTANCE`: a process skips its own), the hash profile
(algorithm, seed, block size), the prompt's end mark, and its block keys (8 bytes each,
little-endian). Entries are outside input (another process, perhaps of another version): one that
does not parse is dropped and counted (`dropped`).

Bounded:
- a prompt of more than `KV_EVENTS_SHARED_MAX_BLOCKS` blocks stays in the process that learned it;
- the stream keeps about `KV_EVENTS_SHARED_ENTRIES` entries, none much older than
  `KV_EVENTS_SHARED_TTL_S` (Redis trims whole nodes of ~100 entries: `~`), and the key expires
  when nothing was added for that long (Redis ≥ 6.2, for MINID);
- a follower reads at most `_COUNT` entries at a time, and keeps them in the store bounded by
  `KV_EVENTS_LEARNED_BLOCKS`. A process that starts reads what the stream still holds.

Without Redis, or with `KV_EVENTS_SHARED_TTL_S = 0`, nothing is shared: each process knows what it
learned itself. While Redis fails, publishing and following pause (logged once, retried after
`REDIS_RETRY_S`, as in `disagg_project.shared_state`) and each process keeps what it has; the
follower resumes after the last entry it read.

All of it runs on the subscriptions' thread, with a `SharedState` of its own there (the
process's other one belongs to the gateway's loop).
"""

from __future__ import annotations

import asyncio
import sys
from array import array
from collections.abc import Callable
from typing import Any

from django.conf import settings

from disagg_project import GATEWAY_INSTANCE, Script, SharedState
from workers.kv_events.hashing import known_algorithm
from workers.kv_events.index import Profile

__all__ = ["entry_fields", "read_entry", "SharedPrompts", "stream_key"]

#: Entries read at a time, and how long a read waits for one.
_COUNT = 64
_BLOCK_S = 1.0
# The largest block size an entry may name (vLLM's CPU backend allows up to a few hundred).
_MAX_BLOCK_SIZE = 1 << 16

# KEYS: the stream; ARGV: its most entries, their time to live (ms), then the entry's fields and
# values. Trimmed by length as it is added to, and by age (the server's clock) after.
_APPEND = Script(
    """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 3))
redis.call('XTRIM', KEYS[1], 'MINID', '~', ms - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

Keep = Callable[[Profile, int, "array[int]"], None]


def stream_key() -> str:
    return f"{settings.REDIS_KEY_PREFIX}kv:learned"


def entry_fields(instance: str, profile: Profile, mark: int, keys: array[int]) -> list[Any]:
    """The stream entry of a learned prompt, as XADD's field / value arguments."""
    if sys.byteorder == "big":
        keys = array("Q", keys)
        keys.byteswap()
    return [b"i", instance, b"a", profile[0], b"s", profile[1], b"b", profile[2], b"m", mark, b"k", keys.tobytes()]


def read_entry(fields: Any, max_blocks: int) -> tuple[str, Profile, int, array[int]] | None:
    """(learning process, profile, mark, block keys) of a stream entry as XREAD gives it (a flat
    list of field and value), or None when it is not one this code writes."""
    if not isinstance(fields, list) or len(fields) % 2:
        return None
    try:
        values = dict(zip(fields[0::2], fields[1::2], strict=True))
        instance, algorithm, seed = values[b"i"].decode(), values[b"a"].decode(), values[b"s"].decode()
        block_size, mark, data = int(values[b"b"]), int(values[b"m"]), values[b"k"]
    except (KeyError, TypeError, ValueError, AttributeError):  # UnicodeDecodeError is a ValueError
        return None
    if (
        not known_algorithm(algorithm) or not 0 < block_size <= _MAX_BLOCK_SIZE or not 0 <= mark < 1 << 64
        or type(data) is not bytes or not data or len(data) % 8 or len(data) > 8 * max_blocks
    ):  # fmt: skip
        return None
    keys = array("Q")
    keys.frombytes(data)
    if sys.byteorder == "big":
        keys.byteswap()
    return instance, (algorithm, seed, block_size), mark, keys


class SharedPrompts:
    """This process's side of the stream: what it learned goes out, what the others learned comes
    in (one per `KvEvents`, created on its thread when Redis is configured)."""

    def __init__(self, keep: Keep, *, instance: str = GATEWAY_INSTANCE) -> None:
        self._keep = keep
        #: This process's name in the entries it appends (it skips them when it reads them back).
        self.instance = instance
        self._state = SharedState(settings.REDIS_URL, serves="learned prompts (KV-cache events)")
        # The id of the last entry read: a follower that stops and starts again goes on from it.
        self._after = b"0-0"
        #: Prompts sent to the stream, kept from it (learned by another process), of the
        #: stream's entries that did not parse, and learned here but too long to share.
        self.sent = 0
        self.received = 0
        self.dropped = 0
        self.too_long = 0

    @staticmethod
    def configured() -> bool:
        return bool(settings.REDIS_URL) and settings.KV_EVENTS_SHARED_TTL_S > 0

    def publish(self, profile: Profile, mark: int, keys: array[int]) -> None:
        """Append a prompt learned here to the stream, in the background (the loop's next write)."""
        if len(keys) > settings.KV_EVENTS_SHARED_MAX_BLOCKS:
            self.too_long += 1
            return
        ttl_ms = max(1, int(settings.KV_EVENTS_SHARED_TTL_S * 1000))
        args = [settings.KV_EVENTS_SHARED_ENTRIES, ttl_ms, *entry_fields(self.instance, profile, mark, keys)]
        self._state.spawn(_APPEND, [stream_key()], args)
        self.sent += 1

    async def follow(self) -> None:
        """Keep every prompt the other processes append, as they append them (until cancelled)."""
        key = stream_key()
        max_blocks = settings.KV_EVENTS_SHARED_MAX_BLOCKS
        while True:
            entries = await self._state.read_stream(key, self._after, count=_COUNT, block_s=_BLOCK_S)
            if entries is None:  # Redis fails (logged once): try again once its pause is over
                await asyncio.sleep(max(0.1, settings.REDIS_RETRY_S))
                continue
            for entry_id, fields in entries:
                self._after = entry_id
                parsed = read_entry(fields, max_blocks)
                if parsed is None:
                    self.dropped += 1
                    continue
                instance, profile, mark, keys = parsed
                if instance != self.instance:
                    self._keep(profile, mark, keys)
                    self.received += 1

    async def aclose(self) -> None:
        await self._state.aclose()
