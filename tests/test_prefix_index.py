"""The gateway's prefix index and the `cache_aware` policy, in-process (no workers)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from workers import router
from workers.prefix_index import PrefixIndex, get_index, prompt_key
from workers.registry import EndpointInfo, PoolInfo
from workers.reservations import Reservation
from workers.writer import get_writer

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 200}
TOOLS = [{"type": "function", "function": {"name": f"tool{i}", "parameters": {"type": "object", "description": "x" * 300}}} for i in range(8)]


def conversation(session: int, turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"session {session}: fix the bug " * 20}]
    for turn in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"answer {turn} " * 300},
            {"role": "user", "content": f"follow-up {turn} " * 100},
        ]
    return {"model": "m", "messages": messages, "tools": TOOLS}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- the prompt key --------------------------------------------------------------------------------


def test_a_later_turn_extends_the_earlier_turns_chunks() -> None:
    first, second = prompt_key(conversation(1, 1), 256), prompt_key(conversation(1, 3), 256)
    assert second.chunks[: len(first.chunks)] == first.chunks
    assert len(second.chunks) > len(first.chunks)
    assert first.root == second.root  # same conversation, same rendezvous key
    assert prompt_key(conversation(2, 1), 256).root != first.root
    # The shared system prompt and tools: the same leading chunks for every conversation.
    other = prompt_key(conversation(2, 1), 256)
    shared = sum(1 for a, b in zip(first.chunks, other.chunks) if a == b)
    assert shared == first.shared_chunks > 0


def test_the_key_ignores_dict_order() -> None:
    chat = conversation(1, 2)
    reordered = {**chat, "messages": [dict(reversed(list(m.items()))) for m in chat["messages"]]}
    assert prompt_key(chat, 256) == prompt_key(reordered, 256)


# --- the index: bounded, LRU, aged, monotone ---------------------------------------------------------


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=30),
    st.integers(1, 60),
)
def test_memory_stays_bounded_per_endpoint(sends: list[tuple[int, int, int]], capacity: int) -> None:
    index = PrefixIndex(capacity, ttl_s=1e9)
    for endpoint, session, turns in sends:
        index.record(endpoint, "p", prompt_key(conversation(session, turns), 512))
        assert all(index.chunks_held(e) <= capacity for e in range(4))
    endpoint, session, turns = sends[-1]
    last = prompt_key(conversation(session, turns), 512)
    if len(last.chunks) <= capacity:
        assert index.match(endpoint, last) == len(last.chunks)


@given(st.integers(0, 6), st.integers(1, 6))
def test_match_is_monotone_over_the_turns(session: int, turns: int) -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    key = prompt_key(conversation(session, turns), 512)
    index.record(1, "p", key)
    # Any earlier turn of the conversation matches whole; any later one at least as far as
    # this one; the match of a later turn never exceeds the recorded chunks.
    for earlier in range(1, turns + 1):
        previous = prompt_key(conversation(session, earlier), 512)
        assert index.match(1, previous) == len(previous.chunks)
    later = prompt_key(conversation(session, turns + 2), 512)
    assert len(key.chunks) == index.match(1, later) <= len(later.chunks)


def test_lru_drops_the_least_recent_conversation_first() -> None:
    a, b, c = (prompt_key({"messages": [{"role": "user", "content": f"{n} " * 2000}]}, 256) for n in "abc")
    index = PrefixIndex(len(a.chunks) * 2, ttl_s=1e9)
    index.record(1, "p", a)
    index.record(1, "p", b)
    assert index.match(1, a) == len(a.chunks)
    index.record(1, "p", a)  # a is now the most recent
    index.record(1, "p", c)
    assert index.match(1, a) == len(a.chunks)
    assert index.match(1, b) == 0
    assert index.match(1, c) == len(c.chunks)


def test_entries_age_out() -> None:
    clock = Clock()
    index = PrefixIndex(10000, ttl_s=60, clock=clock)
    key = prompt_key(conversation(1, 2), 256)
    index.record(1, "p", key)
    clock.now = 59
    assert index.match(1, key) == len(key.chunks)
    clock.now = 61
    assert index.match(1, key) == 0
    index.record(2, "p", key)  # any write sweeps what has aged out at the old end
    index.record(1, "p", prompt_key(conversation(2, 1), 256))
    assert index.chunks_held(1) == len(prompt_key(conversation(2, 1), 256).chunks)


def test_forget_and_retain() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    key = prompt_key(conversation(1, 2), 256)
    for endpoint in (1, 2, 3):
        index.record(endpoint, "p", key)
    index.record(9, "other", key)
    index.forget(1)
    index.retain("p", [3])
    assert index.match(1, key) == index.match(2, key) == 0
    assert index.match(3, key) == index.match(9, key) == len(key.chunks)


# --- the cache_aware policy ------------------------------------------------------------------------

GEN = [EndpointInfo(id=9100 + i, pool_name="ca", role="generation", url=f"http://g{i}", enabled=True, draining=False, healthy=True) for i in range(4)]


def pool(*endpoints: EndpointInfo) -> PoolInfo:
    return PoolInfo(
        id=91, name="ca", model="m", schedule_style="context_first", max_local_prefill_tokens=0,
        routing="cache_aware", protocol="trtllm", created_at=datetime.now(timezone.utc),
        endpoints=endpoints or tuple(GEN),
    )


@pytest.fixture
def placed(transactional_db: Any) -> Iterator[list[Reservation]]:
    """Reservations a test took, released at its end."""
    taken: list[Reservation] = []
    get_index().retain("ca", [])
    yield taken
    for reservation in taken:
        if reservation.released_at is None:
            reservation.release("success")
    get_index().retain("ca", [])
    get_writer().flush()  # the reservation rows, while the test database is still ours


def place(taken: list[Reservation], chat: dict[str, Any], *, session: str | None = None, cluster: PoolInfo | None = None) -> router.Placement:
    placement = router.place_generation(cluster or pool(), f"req-{len(taken)}", chat, session=session)
    taken.append(placement.reservation)
    return placement


def answered(placement: router.Placement) -> None:
    """What the pipeline does on the generation worker's first token."""
    assert placement.key is not None
    get_index().confirm(placement.reservation.endpoint.id, placement.key)


def test_a_conversation_stays_where_its_prefix_is(placed: list[Reservation]) -> None:
    first = place(placed, conversation(1, 1))
    assert first.matched_bytes < first.prompt_bytes
    # Sent but not answered yet: the next turn follows it, but nothing counts as held.
    early = place(placed, conversation(1, 2))
    assert early.reservation.endpoint == first.reservation.endpoint and early.matched_bytes == 0
    answered(first)
    placed[-1].release("success")
    placed[-2].release("success")
    for turns in (2, 3, 4):
        later = place(placed, conversation(1, turns))
        answered(later)
        placed[-1].release("success")
        assert later.reservation.endpoint == first.reservation.endpoint
        # The previous turn is held: everything but the new messages (and a partial chunk).
        earlier = prompt_key(conversation(1, turns - 1), 2048)
        assert later.matched_bytes == len(earlier.chunks) * 2048
        assert later.match_length(1000) == 1000 * later.matched_bytes // later.prompt_bytes


def test_new_conversations_spread_by_rendezvous_and_every_process_agrees(placed: list[Reservation]) -> None:
    chosen = {}
    for session in range(40):
        chosen[session] = place(placed, conversation(session, 1)).reservation.endpoint.url
        placed[-1].release("success")
    assert len(set(chosen.values())) == 4
    # A second process (an empty index) sends each conversation's next turn to the same place.
    get_index().retain("ca", [])
    for session in range(40):
        assert place(placed, conversation(session, 2)).reservation.endpoint.url == chosen[session]
        placed[-1].release("success")


def test_with_a_session_header_the_first_turn_goes_where_session_affinity_would(placed: list[Reservation]) -> None:
    for n in range(10):
        session = f"session-{n}"
        expected = router._session_affinity(pool(), "generation", list(GEN), session)
        assert place(placed, conversation(n, 1), session=session).reservation.endpoint == expected
        placed[-1].release("success")


@override_settings(PREFIX_BALANCE_ABS_THRESHOLD=2, PREFIX_BALANCE_REL_THRESHOLD=1.5)
def test_an_overloaded_holder_is_skipped_for_the_least_loaded(placed: list[Reservation]) -> None:
    home = place(placed, conversation(7, 1)).reservation.endpoint
    # Keep it busy: three more open requests on it (its own conversation's turns).
    for _ in range(2):
        assert place(placed, conversation(7, 2)).reservation.endpoint == home
    # load 3 vs 0: over both thresholds
    moved = place(placed, conversation(7, 3))
    assert moved.reservation.endpoint != home
    assert moved.matched_bytes == 0  # the least-loaded endpoint was never sent this conversation


def test_an_endpoint_that_leaves_or_fails_its_probe_is_forgotten(placed: list[Reservation]) -> None:
    home = place(placed, conversation(3, 1)).reservation.endpoint
    placed[-1].release("success")
    assert get_index().chunks_held(home.id) > 0
    others = tuple(e for e in GEN if e != home)
    place(placed, conversation(4, 1), cluster=pool(*others))
    assert get_index().chunks_held(home.id) == 0
    # Back in the pool, it holds nothing as far as the index knows: the next turn matches none of it.
    placed[-1].release("success")
    again = place(placed, conversation(3, 2))
    assert again.matched_bytes == 0 or again.reservation.endpoint != home


def test_other_policies_do_not_touch_the_index(placed: list[Reservation]) -> None:
    round_robin = PoolInfo(
        id=92, name="rr", model="m", schedule_style="context_first", max_local_prefill_tokens=0,
        routing="round_robin", protocol="trtllm", created_at=datetime.now(timezone.utc), endpoints=tuple(GEN),
    )
    placement = place(placed, conversation(1, 1), cluster=round_robin)
    assert placement.key is None and placement.match_length(5000) == 0
    assert get_index().chunks_held(placement.reservation.endpoint.id) == 0
