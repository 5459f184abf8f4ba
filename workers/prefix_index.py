"""What each generation endpoint probably holds in its prefix cache, as this process has seen it.

The gateway routes before any worker has tokenized the prompt, so the index keys prompts by their
rendered form: the OpenAI chat body's tools and messages, each serialized canonically (sorted
keys) one after another, cut into `PREFIX_INDEX_CHUNK_BYTES` chunks, each chunk's hash chained
over every chunk before it (as engines chain KV block hashes over token ids: here CRC-32, which
chains by construction and is the cheapest hash in the standard library, tagged with the chunk's
position; a collision costs one wrong routing guess, never a wrong answer). An endpoint matches
a prompt up to its first chunk it has not been sent. Matches are in bytes; the pipeline scales
them to the prompt's estimated token count.

A prompt is recorded when it is routed, as *sent*: routing follows it at once (the next turn,
or another conversation with the same head, goes where it went), but the endpoint does not hold
its KV until it has prefilled it. It becomes *held* when the endpoint's first token arrives.
Conditional disaggregation counts only held chunks: a conversation that starts while another
with the same system prompt is still in its context phase must not be sent without one to a
worker that has nothing yet.

Bounded and aged like the worker's own cache: per endpoint, least recently used chunks beyond
`PREFIX_INDEX_CHUNKS_PER_ENDPOINT` are dropped, and a chunk not sent for `PREFIX_INDEX_TTL_S`
counts as evicted. A prompt's chunks are touched last-chunk-first, so the shared head of a
conversation outlives its tail, as in the simulated (and vLLM's) cache.

An endpoint's entries are dropped when its cache is probably gone:
- it leaves the pool, is disabled, or its health probe marks it unhealthy (`retain`, called at
  each routing decision): a worker that was down long enough for the prober to notice has very
  likely restarted with an empty cache;
- a request to it fails in a way that says the endpoint itself failed (refused, reset or cut
  connection, timeout; `workers.health.failure_scope` ENDPOINT): the process may have died, and
  a restart between two probes would otherwise go unnoticed;
- the worker itself reports fewer cached tokens than expected for a prompt (`correct`): the index
  is cut back to what the worker said it held, which also heals a silent restart, one
  conversation at a time.

The index is per gateway process; nothing is shared between processes. They agree without
coordination on where a conversation goes when their own index knows nothing of it beyond the
shared system prompt and tools (its first turn, or a later turn reaching a process that has not
seen it): rendezvous hashing over the conversation's root (its session id when the client sends
one, else the hash of the tools and messages up to the first user message) ranks the endpoints
the same way in every process, and the conversation takes the first of the top two unless the
second is less loaded (two choices, so that new conversations spread). Processes therefore agree
on the endpoint while those two are equally loaded, and always on the pair. Once a process has
sent a conversation somewhere, it follows its index. So one conversation can be prefilled twice,
on two endpoints, when its turns reach two processes that saw different loads, or when the load
guard moves it: the cost is one extra prefill, never a wrong answer. Sharing the index (Redis,
the database, or the workers' KV events) would remove that; the per-request cost of a remote
lookup was not worth it here.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

_OPTIONS = orjson.OPT_SORT_KEYS


@dataclass(frozen=True, slots=True)
class PromptKey:
    """A prompt as the index sees it."""

    #: Chained hash of each full chunk of the rendered prompt.
    chunks: tuple[int, ...]
    chunk_bytes: int
    #: Length of the rendered prompt, in bytes.
    size: int
    #: Stable across processes: the conversation's root (tools and messages up to the first user
    #: message), for rendezvous hashing when no index knows the conversation.
    root: bytes
    #: Chunks that lie wholly before the first user message: a match no longer than this is only
    #: what every conversation of an application shares (system prompt, tools).
    shared_chunks: int


def prompt_key(chat: dict[str, Any], chunk_bytes: int) -> PromptKey:
    """The rendered prompt's chunk hashes and root."""
    parts: list[bytes] = [orjson.dumps(tool, option=_OPTIONS) for tool in chat.get("tools") or ()]
    shared_end = root_end = -1
    for message in chat.get("messages") or ():
        if root_end < 0 and isinstance(message, dict) and message.get("role") == "user":
            shared_end = sum(len(p) for p in parts)
            parts.append(orjson.dumps(message, option=_OPTIONS))
            root_end = shared_end + len(parts[-1])
        else:
            parts.append(orjson.dumps(message, option=_OPTIONS))
    rendered = b"".join(parts)
    if root_end < 0:
        shared_end = root_end = len(rendered)
    view = memoryview(rendered)
    crc32 = zlib.crc32
    # The CRC of each whole prefix (crc32(chunk, previous) continues the previous one), tagged
    # with the chunk's number: small ints, the cheapest key a dict holds.
    chunks: list[int] = []
    crc = 0
    for number, start in enumerate(range(0, len(rendered) - chunk_bytes + 1, chunk_bytes)):
        crc = crc32(view[start : start + chunk_bytes], crc)
        chunks.append(number << 32 | crc)
    root_chunks = root_end // chunk_bytes
    head = chunks[root_chunks - 1] if root_chunks else 0
    # Rendezvous wants a well-mixed key; this hashes at most one chunk.
    root = hashlib.blake2b(view[root_chunks * chunk_bytes : root_end], key=head.to_bytes(8, "little"), digest_size=16).digest()
    return PromptKey(tuple(chunks), chunk_bytes, len(rendered), root, shared_end // chunk_bytes)


@dataclass(slots=True)
class _EndpointEntries:
    pool: str
    # chunk hash -> when it was last sent there (monotonic), negated while only sent (not yet
    # known to be held); least recent first.
    chunks: OrderedDict[int, float]


class PrefixIndex:
    def __init__(
        self, capacity_chunks: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity_chunks = capacity_chunks
        self.ttl_s = ttl_s
        self._clock = clock
        self._endpoints: dict[int, _EndpointEntries] = {}

    def match(self, endpoint_id: int, key: PromptKey) -> int:
        """How many leading chunks of the prompt were sent to the endpoint (for routing)."""
        return self._match(endpoint_id, key, held_only=False)

    def held(self, endpoint_id: int, key: PromptKey) -> int:
        """How many leading chunks of the prompt the endpoint is known to hold (its first token
        for them came back)."""
        return self._match(endpoint_id, key, held_only=True)

    def _match(self, endpoint_id: int, key: PromptKey, *, held_only: bool) -> int:
        entries = self._endpoints.get(endpoint_id)
        if entries is None:
            return 0
        chunks = entries.chunks
        oldest = self._clock() - self.ttl_s
        matched = 0
        for chunk in key.chunks:
            at = chunks.get(chunk)
            if at is None or abs(at) < oldest or (held_only and at < 0):
                break
            matched += 1
        return matched

    def record(self, endpoint_id: int, pool: str, key: PromptKey) -> None:
        """The prompt was sent to the endpoint: it will hold its prefix (`confirm` once it does)."""
        entries = self._endpoints.get(endpoint_id)
        if entries is None:
            entries = self._endpoints[endpoint_id] = _EndpointEntries(pool, OrderedDict())
        chunks = entries.chunks
        now = self._clock()
        for chunk in reversed(key.chunks):
            at = chunks.get(chunk)
            chunks[chunk] = now if at is not None and at > 0 else -now
            chunks.move_to_end(chunk)
        self._evict(chunks, now)

    def confirm(self, endpoint_id: int, key: PromptKey) -> None:
        """The endpoint answered the prompt: it holds the prefix now."""
        entries = self._endpoints.get(endpoint_id)
        if entries is None:
            return
        chunks = entries.chunks
        now = self._clock()
        for chunk in key.chunks:
            if chunk in chunks:
                chunks[chunk] = now

    def forget(self, endpoint_id: int) -> None:
        """The endpoint's cache is gone (it restarted, failed, or left)."""
        self._endpoints.pop(endpoint_id, None)

    def retain(self, pool: str, keep: Iterable[int]) -> None:
        """Forget the pool's endpoints other than `keep`."""
        kept = set(keep)
        for endpoint_id in [i for i, e in self._endpoints.items() if e.pool == pool and i not in kept]:
            del self._endpoints[endpoint_id]

    def chunks_held(self, endpoint_id: int | None = None) -> int:
        if endpoint_id is not None:
            entries = self._endpoints.get(endpoint_id)
            return len(entries.chunks) if entries is not None else 0
        return sum(len(e.chunks) for e in self._endpoints.values())

    def endpoints(self) -> list[int]:
        return list(self._endpoints)

    def _evict(self, chunks: OrderedDict[int, float], now: float) -> None:
        oldest = now - self.ttl_s
        while chunks and (len(chunks) > self.capacity_chunks or abs(next(iter(chunks.values()))) < oldest):
            chunks.popitem(last=False)


_index: PrefixIndex | None = None


def get_index() -> PrefixIndex:
    """This process's index, sized by the settings on first use."""
    global _index
    if _index is None:
        from django.conf import settings

        _index = PrefixIndex(settings.PREFIX_INDEX_CHUNKS_PER_ENDPOINT, settings.PREFIX_INDEX_TTL_S)
    return _index


__all__ = ["PrefixIndex", "PromptKey", "get_index", "prompt_key"]
