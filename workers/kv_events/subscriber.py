"""The gateway's subscriptions to its engines' KV-cache events, on a thread of their own.

    kv_events.sync(snapshot)          start / stop / restart subscriptions to match the endpoints' settings
    kv_events.view                    endpoint id -> EndpointBlocks (read by routing and the overview)
    kv_events.on_routed(endpoint_id)  a request went there (for the silence check; two dict lookups)
    kv_events.check()                 the periodic check: silence, fallbacks logged and counted
    kv_events.learn(endpoint_id, mark, token_ids)    a prompt's token ids, from its worker's answer
    kv_events.known_prefix(blocks, prompt)           -> (bytes, block keys) of its longest learned earlier prompt

Joining prompts to blocks: the gateway routes before any worker tokenizes a prompt, so it learns
a prompt's token ids from the answer of a worker whose events it follows (vLLM's
`return_token_ids`, TensorRT-LLM's context answer, read here;
`workers.schedule.cache_feedback.CacheFeedback.on_prompt_tokens`) and hashes them here, off the
loop, as the engine does (the endpoint's algorithm, seed and block size; or by their tokens). They
are kept under the prompt's end mark (`workers.routing.prefix_index.PromptKey`): the next turn of
the conversation, which extends that prompt, finds it among the places where an earlier prompt
may have ended (`Prompt.candidates`), and each endpoint is scored by how many of its leading
blocks the engine holds (`EndpointBlocks.leading`, a bisection). Bounded: at most
`KV_EVENTS_LEARNED_BLOCKS` block keys in all (8 bytes each), the least recently learned dropped.
With Redis, what one process learns is kept by every process (`workers.kv_events.shared`, a
stream followed on this thread): a conversation's next turn is scored the same whichever process
it reaches.

Each endpoint with a KV-event address (`WorkerEndpoint.kv_events_address`) gets one SUB socket
(ZeroMQ reconnects by itself) and, with a replay address, a DEALER socket to the engine's replay
ROUTER. On connecting, the subscription asks for a replay from seq 0 (everything still in the
engine's ring), then reads the live stream, `[topic, seq (8 bytes, big-endian), payload]`, and
hands each batch to the endpoint's `EndpointBlocks`, which asks for a replay when a seq is
missing. A replay request is `[b"", start_seq]`; the answer is `[b"", topic, seq, payload]` per
batch (`[b"", seq, payload]` before vLLM PR #45177), ended by a batch whose seq is -1. A replay
the engine does not end within `KV_EVENTS_REPLAY_TIMEOUT_S` holds the next ones back for
`KV_EVENTS_REPLAY_BACKOFF_S`: a gap meanwhile is lost at once (the endpoint falls back) rather
than stopping the live stream for another timeout.

Everything here (receiving, decoding, hashing, applying) runs on the subscriptions' own event loop
in a daemon thread, never on the gateway's: routing only reads the indexes (dict lookups, safe
under the GIL against a writer that never iterates a dict a reader iterates). Bounded: each SUB
socket keeps at most `KV_EVENTS_HWM` messages queued (ZeroMQ drops the rest, which the next seq
shows as a gap), a payload over `KV_EVENTS_MAX_BYTES` is dropped the same way, and each index is
bounded (`EndpointBlocks`).

A fallback (`EndpointBlocks.fallback`) is counted once per change in the Prometheus counter
`gateway_kv_events_fallbacks_total{reason}` and logged once; the overview shows the reason.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from django.conf import settings
from prometheus_client import Counter

from workers.kv_events.decode import BadEvents, decode_batch
from workers.kv_events.hashing import BlockHasher, TokenKeys, hasher_for
from workers.kv_events.index import EndpointBlocks, Profile
from workers.kv_events.shared import SharedPrompts

if TYPE_CHECKING:
    from workers.routing.prefix_index import Prompt

__all__ = ["EventSource", "kv_events", "KvEvents"]

logger = logging.getLogger(__name__)

FALLBACKS = Counter(
    "gateway_kv_events_fallbacks", "Endpoints put on the approximate prefix index, by why (counted once per change)", ["reason"]
)
BATCHES = Counter("gateway_kv_events_batches", "KV-cache event batches applied to the endpoints' block indexes")
REPLAYS = Counter(
    "gateway_kv_events_replays",
    "Replays of missed KV-cache events: answered, unanswered (the engine's replay socket was silent), "
    "skipped (not asked: within KV_EVENTS_REPLAY_BACKOFF_S of an unanswered one)",
    ["outcome"],
)

_END = b"\xff" * 8  # -1 as 8 bytes: the replay's end marker


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where and how one endpoint's engine publishes its KV-cache events (the endpoint's settings)."""

    address: str
    replay_address: str
    block_size: int
    #: `--prefix-caching-hash-algo` ("" : hashes are not checked).
    hash_algorithm: str
    #: The seed of the engine's NONE_HASH (its PYTHONHASHSEED; "" : vLLM's default).
    hash_seed: str = ""
    topic: str = ""

    @classmethod
    def of(cls, endpoint: Any) -> EventSource | None:
        address = getattr(endpoint, "kv_events_address", "")
        if not address:
            return None
        return cls(
            address, endpoint.kv_events_replay_address, endpoint.kv_block_size or 16, endpoint.kv_hash_algorithm,
            endpoint.kv_hash_seed, endpoint.kv_events_topic,
        )


def _frames(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a live message `[topic, seq, payload]` or a replayed one without its empty
    first frame (`[topic, seq, payload]` or `[seq, payload]`); None for the end marker."""
    if len(frames) >= 3:
        seq_frame, payload = frames[-2], frames[-1]
    elif len(frames) == 2:
        seq_frame, payload = frames
    else:
        raise BadEvents(f"a message of {len(frames)} frames")
    if seq_frame == _END:
        return None
    if len(seq_frame) != 8:
        raise BadEvents("a sequence frame that is not 8 bytes")
    return int.from_bytes(seq_frame, "big"), payload


class _Subscription:
    def __init__(self, blocks: EndpointBlocks, source: EventSource, context: zmq.asyncio.Context) -> None:
        self.blocks = blocks
        self.source = source
        self.context = context
        # Until when a gap is not replayed, after a replay the engine did not answer: each attempt
        # stops the live stream for up to KV_EVENTS_REPLAY_TIMEOUT_S, and a silent replay socket
        # (engine overloaded, port wrong) would otherwise cost that on every later gap.
        self._replays_resume_at = 0.0

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, settings.KV_EVENTS_HWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, settings.KV_EVENTS_MAX_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.address)
        try:
            await self._ask_replay(0)
            self.blocks.joined()
            while True:
                frames = await sub.recv_multipart()
                try:
                    parsed = _frames(frames)
                    if parsed is None:
                        continue
                    seq, payload = parsed
                    batch = decode_batch(payload)
                except BadEvents as exc:
                    self.blocks.broken(f"an undecodable batch ({exc})")
                    continue
                replay = self.blocks.on_live(seq, batch, time.monotonic())
                BATCHES.inc()
                if replay is not None:
                    answered = await self._ask_replay(replay.start_seq)
                    self.blocks.replay_done(time.monotonic(), answered=answered)
        finally:
            sub.close(linger=0)

    async def _ask_replay(self, start_seq: int) -> bool:
        """Replay from `start_seq` unless there is no replay socket or it is backed off (llm-d
        backs off 30 s the same way); True when the engine ended its answer."""
        if not self.source.replay_address:
            return False
        if time.monotonic() < self._replays_resume_at:
            REPLAYS.labels("skipped").inc()
            return False
        answered = await self._replay(start_seq)
        REPLAYS.labels("answered" if answered else "unanswered").inc()
        if not answered:
            self._replays_resume_at = time.monotonic() + settings.KV_EVENTS_REPLAY_BACKOFF_S
        return answered

    async def _replay(self, start_seq: int) -> bool:
        """Ask for every batch from `start_seq` on; True when the engine ended its answer."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, settings.KV_EVENTS_MAX_BYTES)
        dealer.connect(self.source.replay_address)
        deadline = time.monotonic() + settings.KV_EVENTS_REPLAY_TIMEOUT_S
        try:
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(int(left * 1000)):
                    return False
                frames = await dealer.recv_multipart()
                try:
                    parsed = _frames(frames[1:] if frames and frames[0] == b"" else frames)
                    if parsed is None:
                        return True
                    seq, payload = parsed
                    batch = decode_batch(payload)
                except BadEvents as exc:
                    self.blocks.broken(f"an undecodable replayed batch ({exc})")
                    continue
                self.blocks.on_replayed(seq, batch, time.monotonic())
                BATCHES.inc()
        finally:
            dealer.close(linger=0)


class KvEvents:
    """Every subscribed endpoint's block index, and the thread the subscriptions run on (one per
    process, `kv_events`)."""

    def __init__(self) -> None:
        #: By endpoint id. Empty while no endpoint has a KV-event address: routing reads nothing.
        self.view: dict[int, EndpointBlocks] = {}
        self._sources: dict[int, EventSource] = {}
        self._tasks: dict[int, Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.asyncio.Context | None = None
        # Per endpoint: when the first request was routed there since its last batch.
        self._routed_since: dict[int, float] = {}
        # Per endpoint: the fallback last logged and counted.
        self._reported: dict[int, str] = {}
        # (hash profile, prompt end mark) -> the prompt's block keys, least recently learned first.
        self._learned: OrderedDict[tuple[Profile, int], array[int]] = OrderedDict()
        self._learned_blocks = 0
        self._hashers: dict[Profile, BlockHasher | TokenKeys] = {}
        # With Redis: the prompts learned here go to the other processes, theirs come here.
        self._shared: SharedPrompts | None = None
        self._following: Future[None] | None = None
        #: Prompts learned, and the CPU seconds their hashing took (on the subscriptions' thread).
        self.prompts_learned = 0
        self.learn_cpu_s = 0.0

    # --- the join -----------------------------------------------------------------------------

    def learn(self, endpoint_id: int, mark: int, token_ids: list[int] | Callable[[], list[int]]) -> None:
        """The prompt ending at `mark` had these token ids on the endpoint, or what the reader
        returns (run, and the ids hashed, on the thread)."""
        blocks = self.view.get(endpoint_id)
        loop = self._loop
        if blocks is None or blocks.profile is None or loop is None:
            return
        loop.call_soon_threadsafe(self._learn, blocks.profile, mark, token_ids)

    def _learn(self, profile: Profile, mark: int, token_ids: list[int] | Callable[[], list[int]]) -> None:
        started = time.thread_time()
        if callable(token_ids):
            try:
                token_ids = token_ids()
            except (ValueError, TypeError):  # binascii.Error and orjson.JSONDecodeError are ValueErrors
                return  # not token ids (a worker is outside input)
        hasher = self._hashers.get(profile)
        if hasher is None:
            hasher = self._hashers[profile] = hasher_for(profile[0], profile[1] or None)
        if not all(type(t) is int and 0 <= t < 1 << 32 for t in token_ids):
            return  # not token ids (a worker is outside input)
        keys = array("Q", hasher.keys(token_ids, profile[2]))
        if not keys:
            return  # shorter than a block: nothing the engine caches
        self._keep(profile, mark, keys)
        if self._shared is not None:
            self._shared.publish(profile, mark, keys)
        self.prompts_learned += 1
        self.learn_cpu_s += time.thread_time() - started

    def _keep(self, profile: Profile, mark: int, keys: array[int]) -> None:
        """Keep a prompt's block keys, learned here or by another process (`SharedPrompts`)."""
        learned = self._learned
        previous = learned.pop((profile, mark), None)
        if previous is not None:
            self._learned_blocks -= len(previous)
        learned[(profile, mark)] = keys
        self._learned_blocks += len(keys)
        while self._learned_blocks > settings.KV_EVENTS_LEARNED_BLOCKS and learned:
            _, dropped = learned.popitem(last=False)
            self._learned_blocks -= len(dropped)

    @property
    def prompts_received(self) -> int:
        """Prompts learned by other gateway processes, kept here from the shared stream."""
        return self._shared.received if self._shared is not None else 0

    def known_prefix(self, blocks: EndpointBlocks, prompt: Prompt) -> tuple[int, array[int]] | None:
        """The longest earlier prompt of this conversation whose blocks were learned under the
        endpoint's hash profile: its length in the prompt's bytes, and its block keys."""
        learned = self._learned
        if not learned or blocks.profile is None:
            return None
        digests, ends = prompt.digests, prompt.ends
        for part in reversed(prompt.candidates):
            keys = learned.get((blocks.profile, digests[part]))
            if keys:
                return ends[part], keys
        return None

    # --- the request path ---------------------------------------------------------------------

    def on_routed(self, endpoint_id: int) -> None:
        """A request was sent to the endpoint: from now on an event is expected. The first such
        time since its last batch is kept; a request routed after a batch that came after it
        starts the wait again (else the check, if it ran only after both, would forget it)."""
        blocks = self.view.get(endpoint_id)
        if blocks is None:
            return
        since = self._routed_since.get(endpoint_id)
        if since is None or blocks.last_event_at >= since:
            self._routed_since[endpoint_id] = time.monotonic()

    def trusted(self, endpoint_id: int) -> EndpointBlocks | None:
        """The endpoint's index, if its events are trusted."""
        blocks = self.view.get(endpoint_id)
        return blocks if blocks is not None and not blocks.fallback else None

    # --- the subscriptions --------------------------------------------------------------------

    def sync(self, endpoints: Iterable[Any]) -> None:
        """Match the subscriptions to `endpoints` (objects with `id` and the KV-event settings of
        `EventSource.of`): new ones start, changed ones restart with an empty index, gone ones stop."""
        wanted = {e.id: source for e in endpoints if getattr(e, "enabled", True) and (source := EventSource.of(e)) is not None}
        for endpoint_id in [i for i in self._sources if wanted.get(i) != self._sources[i]]:
            self._stop(endpoint_id)
        for endpoint_id, source in wanted.items():
            if endpoint_id not in self._sources:
                self._start(endpoint_id, source)

    def _start(self, endpoint_id: int, source: EventSource) -> None:
        loop = self._thread_loop()
        hasher = hasher_for(source.hash_algorithm, source.hash_seed or None) if source.hash_algorithm else None
        blocks = EndpointBlocks(
            endpoint_id, hasher, source.block_size, max_blocks=settings.KV_EVENTS_MAX_BLOCKS, digests_kept=settings.KV_EVENTS_DIGESTS_KEPT
        )
        if source.hash_algorithm:
            blocks.profile = (source.hash_algorithm, source.hash_seed, source.block_size)
        self.view[endpoint_id] = blocks
        self._sources[endpoint_id] = source

        async def start() -> None:
            assert self._context is not None
            await _forever(_Subscription(blocks, source, self._context), endpoint_id)

        self._tasks[endpoint_id] = asyncio.run_coroutine_threadsafe(start(), loop)
        if self._shared is None and SharedPrompts.configured():
            # Followed from the first subscription on, until `stop_all` (an idle follower costs
            # one blocking read a second).
            self._shared = SharedPrompts(self._keep)
            self._following = asyncio.run_coroutine_threadsafe(_follow(self._shared), loop)

    def _stop(self, endpoint_id: int) -> None:
        task = self._tasks.pop(endpoint_id, None)
        if task is not None:
            task.cancel()
        self._sources.pop(endpoint_id, None)
        self.view.pop(endpoint_id, None)
        self._routed_since.pop(endpoint_id, None)
        self._reported.pop(endpoint_id, None)

    def stop_all(self) -> None:
        for endpoint_id in list(self._sources):
            self._stop(endpoint_id)
        if self._following is not None:
            self._following.cancel()
        self._following = self._shared = None

    def _thread_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                self._context = zmq.asyncio.Context()
                ready.set()
                loop.run_forever()

            threading.Thread(target=run, name="kv-events", daemon=True).start()
            ready.wait()
            self._loop = loop
        return self._loop

    # --- the check ----------------------------------------------------------------------------

    def check(self) -> None:
        """Mark endpoints whose events stopped while requests were sent, and log and count each
        endpoint's change of fallback once."""
        now = time.monotonic()
        silence = settings.KV_EVENTS_SILENCE_S
        for endpoint_id, blocks in list(self.view.items()):
            since = self._routed_since.get(endpoint_id)
            if since is not None and blocks.last_event_at >= since:
                del self._routed_since[endpoint_id]
            elif since is not None and now - since > silence:
                blocks.mark_silent(f"no KV-cache event for {now - since:.0f} s while requests were sent", since=since)
            reason = blocks.fallback
            if reason != self._reported.get(endpoint_id, ""):
                self._reported[endpoint_id] = reason
                source = self._sources.get(endpoint_id)
                where = source.address if source else f"#{endpoint_id}"
                if reason:
                    FALLBACKS.labels(reason).inc()
                    logger.warning(
                        "KV-cache events of endpoint #%s (%s): %s; routing uses the approximate prefix index for it",
                        endpoint_id, where, blocks.detail,
                    )
                else:
                    logger.warning("KV-cache events of endpoint #%s (%s) are trusted again", endpoint_id, where)

    def summary(self, endpoint_id: int) -> dict[str, Any] | None:
        """What the overview shows of one endpoint's events (None: it has no KV-event address)."""
        blocks = self.view.get(endpoint_id)
        if blocks is None:
            return None
        return {
            "blocks": blocks.size, "fallback": blocks.fallback, "detail": blocks.detail, "seq": blocks.applied_seq,
            "stored": blocks.stored, "removed": blocks.removed, "checked": blocks.checked, "resets": blocks.resets, "gaps": blocks.gaps,
            "keyed": blocks.keyed, "unkeyed": blocks.unkeyed,
        }


async def _forever(subscription: _Subscription, endpoint_id: int) -> None:
    while True:
        try:
            await subscription.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the KV-event subscription of endpoint #%s failed; reconnecting", endpoint_id)
            subscription.blocks.broken("the subscription failed")
        await asyncio.sleep(1.0)


async def _follow(shared: SharedPrompts) -> None:
    try:
        while True:
            try:
                await shared.follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("following the prompts other gateway processes learned failed; following again")
            await asyncio.sleep(1.0)
    finally:
        await shared.aclose()


kv_events = KvEvents()
