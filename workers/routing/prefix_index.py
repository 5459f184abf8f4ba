"""What each endpoint probably holds in its prefix cache, as this process has seen it.

The gateway routes before any worker has tokenized the prompt, so the index keys prompts by their
rendered form: the OpenAI chat body's tools (one part), then each message (one part each),
serialized as they go to the worker (`workers.schedule.rendered_chat.RenderedChat`). Each part's digest is
xxh3-64 seeded with the digest of the parts before it, so a digest stands for the whole prompt up
to that part's end (as engines chain KV block hashes over token ids; a collision costs one wrong
routing guess, never a wrong answer).
A recorded prompt leaves a few *marks* (digests) per endpoint, not one per part:
- a chunk mark about every `PREFIX_INDEX_CHUNK_BYTES` (the part that reaches past each multiple):
  an endpoint's chunk marks of one chain are prefix-closed, so the longest match is found by
  bisection, a few lookups however long the prompt;
- the end of the shared head (the parts before the first user message), so that a new
  conversation matches exactly what every conversation of its application shares;
- the prompt's end, so that the next turn, which extends it, matches exactly up to it: beyond the
  last chunk mark an endpoint holds, the lookup tries the places where an earlier prompt may have
  ended (each part followed by an assistant message: a prompt ends where its answer begins),
  longest first.
Matches are in bytes; the pipeline scales them to the prompt's estimated token count.

A pool that keeps keys' caches apart (`CacheScope.KEY`) seeds the chain with the tenant's salt
(`Prompt(..., salt=)`), as the engines mix their `cache_salt` into a prompt's first KV block: one
tenant's marks never match another's prompt, so another tenant's prompt neither steers routing
nor lets a request skip its context phase, and the rendezvous root is the tenant's own.

Cost (bench/sessions.py, a 188 KB Claude Code-shaped prompt of 20 messages, 4 generation and 2
context endpoints, 2-core VM): 16.6-18.2 µs of CPU per request that skips the context phase,
20.5-21.6 µs with one; the key is 9.5-10.2 µs of that, 3.3 µs of it xxh3 over the bytes. The key
reads the prompt as `RenderedChat` serialized it for the worker bodies, so the index does not
serialize it again: serializing the tools and messages for the key alone was 12 µs more (the
previous form, 28-40 µs for the key). CRC-32 over 2 KiB chunks of a joined, key-sorted rendering (the scheme before that)
took ~400 µs, most of it in the hash and in page faults of the prompt-sized buffer.

A prompt is recorded when it is routed, as *sent*: routing follows it at once (the next turn,
or another conversation with the same head, goes where it went), but the endpoint does not hold
its KV until it has prefilled it. It becomes *held* when the endpoint's first token arrives.
Conditional disaggregation counts only held marks: a conversation that starts while another
with the same system prompt is still in its context phase must not be sent without one to a
worker that has nothing yet.

Bounded and aged like the worker's own cache: per endpoint, least recently used marks beyond
`PREFIX_INDEX_CHUNKS_PER_ENDPOINT` are dropped (a mark stands for about a chunk of prompt), and a
mark not sent for `PREFIX_INDEX_TTL_S` counts as evicted. A prompt's marks are touched
last-first, so the shared head of a conversation outlives its tail, as in the simulated (and
vLLM's) cache.

Context endpoints are indexed too: a context phase goes where the most of its prompt was sent
(`workers.routing.router.reserve` with the placement), and a context worker holds the prefix once it has
answered.

An endpoint's entries are dropped when its cache is probably gone:
- it leaves the pool, is disabled, or its health probe marks it unhealthy (`retain`, called at
  each routing decision): a worker that was down long enough for the prober to notice has very
  likely restarted with an empty cache;
- a request to it fails in a way that says the endpoint itself failed (refused, reset or cut
  connection, timeout; `workers.cluster.health.failure_scope` ENDPOINT): the process may have died, and
  a restart between two probes would otherwise go unnoticed;
- the worker itself reports no cached tokens for a prompt the index expected it to hold
  (`workers.schedule.cache_feedback`, `CacheFeedback.on_usage`): its entries are dropped and that
  prompt recorded anew, which heals a silent restart.

The index is per gateway process; nothing is shared between processes. They agree without
coordination on where a conversation goes when their own index knows nothing of it beyond the
shared system prompt and tools (its first turn, or a later turn reaching a process that has not
seen it): rendezvous hashing over the conversation's root (its session id when the client sends
one, else the digest of the tools and messages up to the first user message) ranks the endpoints
the same way in every process, and the conversation takes the one of the top two that serves
fewer conversations (`conversations`: those with a turn sent there within
`PREFIX_BALANCE_WINDOW_S`), then has fewer open requests, then the first (two choices, so that
conversations spread evenly: the hash alone left 1.8x more open requests on the busiest of 4
endpoints than on the mean, with 16 sessions). Processes therefore agree on the endpoint when
they count the same conversations there, and always on the pair. Once a process has
sent a conversation somewhere, it follows its index. So one conversation can be prefilled twice,
on two endpoints, when its turns reach two processes that saw different loads, or when the load
guard moves it: the cost is one extra prefill, never a wrong answer. Sharing the index (Redis,
the database, or the workers' KV events) would remove that; the per-request cost of a remote
lookup was not worth it here. For endpoints whose KV-cache events are followed, the prompts
learned from the workers' answers are shared instead, in the background
(`workers.kv_events.shared`): there every process scores a conversation's next turn on the
same blocks, with no lookup per request.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

from xxhash import xxh3_64_intdigest

from workers.schedule.rendered_chat import RenderedChat


class PromptKey(NamedTuple):
    """What the index records of a prompt: its marks, each the chained digest of the prompt up to
    an offset, in offset order (every full chunk's end, the shared head's end, the prompt's end).
    Small: a request keeps it until its worker answers. (A named tuple: one is built per
    request, and a frozen dataclass takes ~0.7 µs to build.)"""

    marks: tuple[int, ...]
    #: Length of the rendered prompt, in bytes.
    size: int
    #: The conversation: the digest of the prompt up to the end of its first user message.
    root: int = 0
    #: The end mark of the turn this prompt extends (the last place before its end where a prompt
    #: ended): once the endpoint holds this one, that one is redundant and dropped, so about one
    #: end mark per conversation stays, and an endpoint's marks stay about proportional to the
    #: prompt text it holds.
    supersedes: int | None = None


class Prompt:
    """A prompt rendered for one routing decision: the tools, then each message, serialized as
    the worker will receive them (`RenderedChat`), each part's digest chained over every part
    before it."""

    __slots__ = ("ends", "digests", "chunk_marks", "chunk_digests", "candidates", "shared", "key")

    def __init__(self, rendered: RenderedChat, chunk_bytes: int, *, salt: int = 0) -> None:
        """`salt` seeds the digest chain: the prompt's tenant (0: the cache every key shares)."""
        # Part 0 is the tools (one part: they all lie in the shared head), then one per message.
        # Not key-sorted: an engine renders the JSON as it is sent, so a reordered schema is
        # another prompt to its cache as well.
        parts = rendered.messages
        digest = xxh3_64_intdigest(rendered.tools, salt)
        digests = [digest]
        for part in parts:
            digest = xxh3_64_intdigest(part, digest)
            digests.append(digest)
        ends = list(accumulate(map(len, parts), initial=len(rendered.tools)))
        size = ends[-1]
        last = len(ends) - 1
        # Where a prompt of this conversation may have ended: before each answer after the first
        # user message (a prompt ends where its answer begins), and the end of the shared head.
        messages = rendered.chat.get("messages")
        if not isinstance(messages, list):
            messages = []
        try:
            roles = [message.get("role") for message in messages]
        except AttributeError:  # a message that is not an object (the converter makes none)
            roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        try:
            shared = roles.index("user")
        except ValueError:
            shared = last
        root = shared + 1 if shared < last else last
        candidates = [shared] if shared < last else []
        candidates += [number for number in range(shared + 1, last) if roles[number] == "assistant"]
        if not candidates or candidates[-1] != last:
            candidates.append(last)
        # The part that reaches past each multiple of chunk_bytes, once however many it reaches
        # past: from each, on to the first multiple beyond its end.
        chunk_marks: list[int] = []
        offset = chunk_bytes
        while offset <= size:
            marked = bisect_left(ends, offset)
            chunk_marks.append(marked)
            offset = (ends[marked] // chunk_bytes + 1) * chunk_bytes
        #: Offset of each part's end, and the digest of the prompt up to it (xxh3-64, each part
        #: seeded with the digest before it: a chain, as engines chain KV block hashes).
        self.ends, self.digests = ends, digests
        #: Parts that reach past a multiple of `chunk_bytes`: the marks every recording keeps,
        #: about one per chunk however the prompt is cut into messages; and their digests.
        self.chunk_marks = chunk_marks
        self.chunk_digests = [digests[i] for i in chunk_marks]
        #: Parts where an earlier prompt may have ended (before an answer; the shared head;
        #: this prompt's end), for a match exact to the message rather than cut to a chunk.
        self.candidates = candidates
        #: The part that ends the shared head (tools and messages before the first user
        #: message): a match no longer than this is only what every conversation of an
        #: application shares.
        self.shared = shared
        marks = sorted({*chunk_marks, shared, last})
        previous = candidates[-2] if len(candidates) > 1 else shared
        supersedes = None if previous in marks else digests[previous]
        self.key = PromptKey(tuple([digests[i] for i in marks]), size, digests[root], supersedes)

    @property
    def size(self) -> int:
        return self.key.size

    @property
    def shared_bytes(self) -> int:
        return self.ends[self.shared]

    @property
    def root(self) -> bytes:
        """Stable across processes: the conversation's root (the prompt up to the end of its
        first user message), for rendezvous hashing when no index knows the conversation."""
        return self.key.root.to_bytes(8, "little")


# What a missing mark reads as: NaN compares false, so a lookup needs no None test.
_MISSING = math.nan
# Added to a held mark's time (when it was last sent), so that one comparison answers both
# questions: sent and fresh (>= now - ttl), held and fresh (>= now - ttl + _HELD). 2**40 s is
# beyond any monotonic clock, and keeps the time to ~0.25 ms.
_HELD = 2.0**40


def _sent_at(value: float) -> float:
    """When a mark was last sent, from its stored value."""
    return value - _HELD if value >= _HELD else value


@dataclass(slots=True)
class _EndpointEntries:
    pool: str
    # mark -> when it was last sent there (monotonic), plus _HELD once known to be held; least
    # recent first.
    marks: OrderedDict[int, float] = field(default_factory=OrderedDict)
    # conversation (`PromptKey.root`) -> when a turn of it was last sent there; least recent first.
    conversations: OrderedDict[int, float] = field(default_factory=OrderedDict)


class PrefixIndex:
    def __init__(
        self,
        capacity_marks: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        conversation_window_s: float = 300.0,
    ) -> None:
        self.capacity_marks = capacity_marks
        self.ttl_s = ttl_s
        self.conversation_window_s = conversation_window_s
        self._clock = clock
        self._endpoints: dict[int, _EndpointEntries] = {}

    def match(self, endpoint_id: int, prompt: Prompt) -> int:
        """How many leading bytes of the prompt were sent to the endpoint (for routing)."""
        return self.matches((endpoint_id,), prompt)[endpoint_id]

    def matches(self, endpoint_ids: Iterable[int], prompt: Prompt) -> dict[int, int]:
        """`match` for each of the endpoints, in one pass."""
        oldest = self._clock() - self.ttl_s
        endpoints = self._endpoints
        return {
            endpoint_id: self._longest(entries.marks, prompt, oldest) if (entries := endpoints.get(endpoint_id)) else 0
            for endpoint_id in endpoint_ids
        }

    def held(self, endpoint_id: int, prompt: Prompt, *, sent: int | None = None) -> int:
        """How many leading bytes of the prompt the endpoint is known to hold (its first token
        for them came back). `sent`, its `match` of a moment ago, saves the search when the
        endpoint holds all of that (a held mark is a sent one, so held <= sent)."""
        entries = self._endpoints.get(endpoint_id)
        if entries is None:
            return 0
        fresh = self._clock() - self.ttl_s + _HELD
        if sent:
            ends = prompt.ends
            part = bisect_left(ends, sent)
            if part < len(ends) and ends[part] == sent and entries.marks.get(prompt.digests[part], _MISSING) >= fresh:
                return sent
        return self._longest(entries.marks, prompt, fresh)

    @staticmethod
    def _longest(marks: OrderedDict[int, float], prompt: Prompt, bound: float) -> int:
        """Bytes of the prompt up to its longest mark stored in `marks` with a value >= `bound`
        (sent and fresh, or held and fresh: see _HELD)."""
        get = marks.get
        chunk_digests = prompt.chunk_digests
        # An endpoint's marks of one chain are prefix-closed (recorded together, touched
        # tail-first so evicted tail-first, aged head-last): the longest matched chunk mark is
        # found by bisection, a few lookups however long the prompt.
        low, high = 0, len(chunk_digests)
        while low < high:
            middle = (low + high + 1) // 2
            if get(chunk_digests[middle - 1], _MISSING) >= bound:
                low = middle
            else:
                high = middle - 1
        chunk_marks, candidates, digests, ends = prompt.chunk_marks, prompt.candidates, prompt.digests, prompt.ends
        matched = chunk_marks[low - 1] if low else -1
        # Up to the next chunk mark (known missing), where an earlier prompt ended: the
        # longest one recorded.
        limit = chunk_marks[low] if low < len(chunk_marks) else len(ends)
        for part in reversed(candidates[bisect_right(candidates, matched) : bisect_left(candidates, limit)]):
            if get(digests[part], _MISSING) >= bound:
                return ends[part]
        return ends[matched] if matched >= 0 else 0

    def record(self, endpoint_id: int, pool: str, key: PromptKey, *, conversation: bool = True) -> None:
        """The prompt was sent to the endpoint: it will hold its prefix (`confirm` once it does).
        `conversation`: count its conversation there (`conversations`; generation endpoints,
        which the balance guard compares)."""
        entries = self._endpoints.get(endpoint_id)
        if entries is None:
            entries = self._endpoints[endpoint_id] = _EndpointEntries(pool)
        marks = entries.marks
        now = self._clock()
        pop = marks.pop
        for mark in reversed(key.marks):
            # Re-inserted, so most recent; held stays held.
            marks[mark] = now + _HELD if pop(mark, _MISSING) >= _HELD else now
        self._evict(marks, now)
        if conversation:
            conversations = entries.conversations
            conversations.pop(key.root, None)
            conversations[key.root] = now
            self._expire(conversations, now)

    def conversations(self, endpoint_id: int) -> int:
        """How many conversations had a turn sent to the endpoint in the last
        `conversation_window_s`: the load a new conversation adds to (sticky conversations keep
        coming back, so the open requests of the moment say little of it)."""
        entries = self._endpoints.get(endpoint_id)
        if entries is None:
            return 0
        self._expire(entries.conversations, self._clock())
        return len(entries.conversations)

    def _expire(self, conversations: OrderedDict[int, float], now: float) -> None:
        oldest = now - self.conversation_window_s
        while conversations and (len(conversations) > self.capacity_marks or next(iter(conversations.values())) < oldest):
            conversations.popitem(last=False)

    def confirm(self, endpoint_id: int, key: PromptKey) -> None:
        """The endpoint answered the prompt: it holds the prefix now."""
        entries = self._endpoints.get(endpoint_id)
        if entries is None:
            return
        marks = entries.marks
        now = self._clock()
        held = now + _HELD
        for mark in key.marks:
            if mark in marks:
                marks[mark] = held
        if key.supersedes is not None and key.marks[-1] in marks:
            marks.pop(key.supersedes, None)

    def forget(self, endpoint_id: int) -> None:
        """The endpoint's cache is gone (it restarted, failed, or left)."""
        self._endpoints.pop(endpoint_id, None)

    def retain(self, pool: str, keep: Iterable[int]) -> None:
        """Forget the pool's endpoints other than `keep`."""
        kept = set(keep)
        for endpoint_id in [i for i, e in self._endpoints.items() if e.pool == pool and i not in kept]:
            del self._endpoints[endpoint_id]

    def marks_held(self, endpoint_id: int | None = None) -> int:
        if endpoint_id is not None:
            entries = self._endpoints.get(endpoint_id)
            return len(entries.marks) if entries is not None else 0
        return sum(len(e.marks) for e in self._endpoints.values())

    def endpoints(self) -> list[int]:
        return list(self._endpoints)

    def _evict(self, marks: OrderedDict[int, float], now: float) -> None:
        oldest = now - self.ttl_s
        while marks and (len(marks) > self.capacity_marks or _sent_at(next(iter(marks.values()))) < oldest):
            marks.popitem(last=False)


_index: PrefixIndex | None = None


def get_index() -> PrefixIndex:
    """This process's index, sized by the settings on first use."""
    global _index
    if _index is None:
        from django.conf import settings

        _index = PrefixIndex(
            settings.PREFIX_INDEX_CHUNKS_PER_ENDPOINT,
            settings.PREFIX_INDEX_TTL_S,
            conversation_window_s=settings.PREFIX_BALANCE_WINDOW_S,
        )
    return _index


__all__ = ["get_index", "PrefixIndex", "Prompt", "PromptKey"]
