"""The subscriptions: the frames of live and replayed messages, a real ZeroMQ publisher followed
on the subscriptions' thread (the sim's, as a worker publishes), and the join of a conversation's
learned prompt to the blocks its next turn scores on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from tests.support.ports import unused_port
from workers.kv_events.decode import BadEvents
from workers.kv_events.hashing import BlockHasher
from workers.kv_events.subscriber import KvEvents, _frames
from workers.routing.prefix_index import Prompt
from workers.schedule.rendered_chat import RenderedChat
from workers.sim.kv_publisher import KvPublisher
from workers.sim.prefix_cache import PrefixCache


def test_frames_of_live_replayed_and_end_messages() -> None:
    seq = (7).to_bytes(8, "big")
    assert _frames([b"topic", seq, b"payload"]) == (7, b"payload")
    assert _frames([seq, b"payload"]) == (7, b"payload")  # replayed, before vLLM PR #45177
    assert _frames([b"", b"\xff" * 8, b""]) is None
    with pytest.raises(BadEvents):
        _frames([b"x", b"short", b"p"])
    with pytest.raises(BadEvents):
        _frames([b"one"])


class Endpoint:
    def __init__(self, endpoint_id: int, address: str, replay: str) -> None:
        self.id, self.enabled = endpoint_id, True
        self.kv_events_address, self.kv_events_replay_address, self.kv_events_topic = address, replay, ""
        self.kv_block_size, self.kv_hash_algorithm, self.kv_hash_seed = 4, "sha256", ""


@pytest.fixture
def publisher() -> Iterator[tuple[KvPublisher, PrefixCache, asyncio.AbstractEventLoop, Endpoint]]:
    """A sim worker's publisher and cache on an event loop of the test's (its replays served there)."""
    address, replay = f"tcp://127.0.0.1:{unused_port()}", f"tcp://127.0.0.1:{unused_port()}"
    loop = asyncio.new_event_loop()
    publisher = KvPublisher(address, replay, buffer_steps=100)
    cache = PrefixCache(4, 1000, BlockHasher("sha256"), publisher.publish)
    loop.run_until_complete(_start(publisher))
    yield publisher, cache, loop, Endpoint(1, address, replay)
    loop.run_until_complete(publisher.close())
    loop.close()


async def _start(publisher: KvPublisher) -> None:
    publisher.start()


def serve_until(loop: asyncio.AbstractEventLoop, condition: Any, timeout: float = 20.0) -> None:
    """Run the publisher's loop (it answers replays) until `condition()` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        loop.run_until_complete(asyncio.sleep(0.02))


@override_settings(KV_EVENTS_REPLAY_TIMEOUT_S=10.0)
def test_a_subscription_replays_what_was_published_before_it_and_follows_the_rest(publisher: Any) -> None:
    pub, cache, loop, endpoint = publisher
    cache.store(list(range(12)))  # before the gateway subscribes: only the replay brings it
    events = KvEvents()
    try:
        events.sync([endpoint])
        blocks = events.view[1]
        serve_until(loop, lambda: blocks.size == 3)
        more = iter(range(100, 10_000, 4))

        def live() -> bool:
            # Until the SUB socket is connected, what is published live is not heard: publish more.
            start = next(more)
            cache.store(list(range(start, start + 4)))
            return blocks.live_seq is not None

        serve_until(loop, live)
        # What was published before the SUB socket joined is replayed (a gap in its seq).
        serve_until(loop, lambda: blocks.size == cache.blocks_held)
        assert blocks.trusted and blocks.checked == cache.blocks_held
        cache.clear()
        serve_until(loop, lambda: blocks.size == 0)
        events.sync([])  # the endpoint's address is gone: the subscription stops
        assert events.view == {}
    finally:
        events.stop_all()


def test_a_learned_prompt_scores_its_next_turn_by_the_blocks_held() -> None:
    events = KvEvents()
    from workers.kv_events.index import EndpointBlocks

    blocks = EndpointBlocks(1, BlockHasher("sha256"), 4)
    blocks.profile = ("sha256", "", 4)
    first = {"messages": [{"role": "user", "content": "hello there"}]}
    tokens = list(range(20))
    prompt = Prompt(RenderedChat(first), 2048)
    events._learn(blocks.profile, prompt.key.marks[-1], tokens)
    keys = BlockHasher("sha256").keys(tokens, 4)
    for key in keys[:3]:
        blocks._blocks[key] = -1
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]}
    later = Prompt(RenderedChat(second), 2048)
    known = events.known_prefix(blocks, later)
    assert known is not None
    size, learned = known
    assert list(learned) == keys and size == prompt.size
    assert blocks.leading(learned) == 3
    # Another profile (block size) learned nothing for it.
    other = EndpointBlocks(2, BlockHasher("sha256"), 8)
    other.profile = ("sha256", "", 8)
    assert events.known_prefix(other, later) is None


@override_settings(KV_EVENTS_LEARNED_BLOCKS=10)
def test_learned_prompts_are_bounded_in_blocks() -> None:
    events = KvEvents()
    profile = ("sha256", "", 4)
    for mark in range(5):
        events._learn(profile, mark, list(range(mark * 100, mark * 100 + 16)))  # 4 blocks each
    assert events._learned_blocks <= 10 and list(events._learned) == [(profile, 3), (profile, 4)]
    events._learn(profile, 9, ["not", "ids", "at", "all"])  # type: ignore[list-item]
    events._learn(profile, 10, [1, 2])  # shorter than a block
    assert (profile, 9) not in events._learned and (profile, 10) not in events._learned


def test_with_redis_a_prompt_learned_by_one_process_scores_the_next_turn_in_another() -> None:
    """Two `KvEvents` (two gateway processes) following the same engine: what one learns from its
    worker's answer, the other finds for the conversation's next turn."""
    import secrets

    from tests.support.redis import redis_url_or_skip

    url = redis_url_or_skip()
    endpoint = Endpoint(1, f"tcp://127.0.0.1:{unused_port()}", "")  # no engine needed: nothing is published
    first = {"messages": [{"role": "user", "content": "hello there"}]}
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]}
    mark, later = Prompt(RenderedChat(first), 2048).key.marks[-1], Prompt(RenderedChat(second), 2048)
    with override_settings(REDIS_URL=url, REDIS_KEY_PREFIX=f"test-kvsub-{secrets.token_hex(4)}:", KV_EVENTS_SHARED_TTL_S=60):
        a, b = KvEvents(), KvEvents()
        try:
            a.sync([endpoint])
            b.sync([endpoint])
            assert a._shared is not None and b._shared is not None
            b._shared.instance = "another process"  # one test process plays two
            a.learn(1, mark, list(range(20)))
            deadline = time.monotonic() + 15
            while (known := b.known_prefix(b.view[1], later)) is None:
                assert time.monotonic() < deadline, "the other process never kept the learned prompt"
                time.sleep(0.01)
            assert list(known[1]) == BlockHasher("sha256").keys(list(range(20)), 4)
            assert b.prompts_received == 1 and b.prompts_learned == 0 and a.prompts_received == 0
        finally:
            a.stop_all()
            b.stop_all()


def test_without_redis_nothing_is_shared() -> None:
    endpoint = Endpoint(1, f"tcp://127.0.0.1:{unused_port()}", "")
    with override_settings(REDIS_URL=""):
        events = KvEvents()
        try:
            events.sync([endpoint])
            assert events._shared is None and events.prompts_received == 0
        finally:
            events.stop_all()


@override_settings(KV_EVENTS_SILENCE_S=0.0)
def test_a_request_routed_after_a_batch_waits_for_the_next_one_however_late_the_check() -> None:
    """The silence check runs every KV_EVENTS_CHECK_S: a batch, then another request, both between
    two checks, must leave that request waiting for an event (it was forgotten, and a publisher
    that went quiet right after that batch was never caught)."""
    from workers.kv_events.index import EndpointBlocks, Fallback

    events = KvEvents()
    blocks = events.view[1] = EndpointBlocks(1, None, 4)
    events.on_routed(1)
    blocks.last_event_at = time.monotonic()  # its batch came
    events.on_routed(1)  # the next request, before the check ran
    time.sleep(0.001)
    events.check()
    assert blocks.fallback == Fallback.SILENT
    events.view.clear()


@override_settings(KV_EVENTS_REPLAY_TIMEOUT_S=0.3, KV_EVENTS_REPLAY_BACKOFF_S=60.0)
def test_a_replay_socket_that_does_not_answer_is_not_asked_again_for_a_while() -> None:
    """The engine's replay socket takes requests and never answers: the subscription asks once (on
    connecting), and a later gap is lost at once instead of waiting out another timeout."""
    import zmq

    from workers.kv_events.subscriber import REPLAYS

    address, replay = f"tcp://127.0.0.1:{unused_port()}", f"tcp://127.0.0.1:{unused_port()}"
    loop = asyncio.new_event_loop()
    publisher = KvPublisher(address)  # live only: its replay address is this test's silent socket
    cache = PrefixCache(4, 1000, BlockHasher("sha256"), publisher.publish)
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(replay)
    asked: list[int] = []

    def count_requests() -> int:
        while silent.poll(0):
            asked.append(int.from_bytes(silent.recv_multipart()[-1], "big"))
        return len(asked)

    skipped = REPLAYS.labels("skipped")._value.get()
    events = KvEvents()
    try:
        events.sync([Endpoint(1, address, replay)])
        blocks = events.view[1]
        more = iter(range(0, 100_000, 4))

        def live() -> bool:
            start = next(more)
            cache.store(list(range(start, start + 4)))
            return blocks.live_seq is not None

        serve_until(loop, live)
        assert count_requests() == 1 and asked == [0]  # the replay on connecting, unanswered
        assert blocks.trusted
        publisher.mode = "drop"
        cache.store([900, 901, 902, 903])  # published to no one: the next live batch shows a gap
        publisher.mode = "live"
        cache.store([910, 911, 912, 913])
        serve_until(loop, lambda: not blocks.trusted)
        assert blocks.fallback == "gap" and blocks.gaps == 1
        assert count_requests() == 1  # not asked again (asked, it would be lost only after a timeout)
        assert REPLAYS.labels("skipped")._value.get() == skipped + 1
    finally:
        events.stop_all()
        silent.close(linger=0)
        loop.run_until_complete(publisher.close())
        loop.close()
