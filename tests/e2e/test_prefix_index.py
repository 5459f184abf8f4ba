"""The gateway's prefix index and the `cache_aware` policy, in-process (no workers)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import orjson
import pytest
from django.test import override_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_project.writer import get_writer
from workers.cluster.registry import EndpointInfo, PoolInfo
from workers.routing import router
from workers.routing.prefix_index import PrefixIndex, Prompt, get_index
from workers.routing.reservations import Reservation
from workers.schedule.rendered_chat import RenderedChat

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


def prompt_of(chat: dict[str, Any], chunk_bytes: int) -> Prompt:
    return Prompt(RenderedChat(chat), chunk_bytes)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- the prompt key --------------------------------------------------------------------------------

CHUNK = 1024


def test_a_later_turn_matches_exactly_up_to_the_earlier_turns_end() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    for turns in range(1, 6):
        earlier, later = prompt_of(conversation(1, turns), CHUNK), prompt_of(conversation(1, turns + 1), CHUNK)
        assert later.root == earlier.root  # same conversation, same rendezvous key
        index.record(1, "p", earlier.key)
        # To the byte: the previous turn's end, not the chunk mark before it.
        assert index.match(1, later) == earlier.size < later.size
        assert earlier.size % CHUNK  # (a match cut to chunks would have been shorter)
    assert prompt_of(conversation(2, 1), CHUNK).root != prompt_of(conversation(1, 1), CHUNK).root


def test_a_shared_head_matches_another_conversation_exactly() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    one, other = prompt_of(conversation(1, 3), CHUNK), prompt_of(conversation(2, 2), CHUNK)
    index.record(1, "p", one.key)
    # The system prompt and tools, no more: both conversations differ from the first user message.
    assert index.match(1, other) == other.shared_bytes == one.shared_bytes > CHUNK
    assert other.shared_bytes % CHUNK


def test_a_changed_message_stops_the_match() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    chat = conversation(1, 4)
    index.record(1, "p", prompt_of(chat, CHUNK).key)
    for changed in range(1, len(chat["messages"])):
        messages = [dict(m) for m in chat["messages"]]
        messages[changed]["content"] += "!"
        edited = prompt_of({**chat, "messages": messages}, CHUNK)
        # Never past the changed message's start (the digest chain covers every byte before).
        assert index.match(1, edited) <= edited.ends[changed]
    tools = [dict(t) for t in chat["tools"]]
    tools[-1] = {**tools[-1], "type": "other"}
    assert index.match(1, prompt_of({**chat, "tools": tools}, CHUNK)) == 0


def test_positions_matter() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    chat = conversation(1, 3)
    index.record(1, "p", prompt_of(chat, CHUNK).key)
    messages = chat["messages"]
    # The same messages in another order, or the same turn behind an extra message: a mark is
    # the digest of everything before it, so nothing past the first difference matches.
    swapped = prompt_of({**chat, "messages": [messages[0], messages[3], messages[2], messages[1], *messages[4:]]}, CHUNK)
    assert index.match(1, swapped) <= swapped.ends[1]
    shifted = prompt_of({**chat, "messages": [messages[0], {"role": "user", "content": "hi"}, *messages[1:]]}, CHUNK)
    assert index.match(1, shifted) <= shifted.ends[1]
    # The same bytes split otherwise between tools and messages are another prompt too.
    moved = prompt_of({"messages": [{"role": "tools", "content": chat["tools"]}, *messages]}, CHUNK)
    assert index.match(1, moved) == 0


# Messages as the gateway may send them: any JSON in the contents, text with escapes and non-ASCII.
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.text() | st.lists(_json, max_size=3)},
    optional={"name": st.text(max_size=8), "tool_calls": st.lists(_json, max_size=2)},
)


def layout_by_definition(chat: dict[str, Any], chunk: int) -> tuple[list[int], list[int], list[int], int, int]:
    """The key's layout as the module's docstring defines it, one part at a time (the key was
    computed this way before it took its parts from `RenderedChat`): each part's end, the parts
    that reach past a multiple of `chunk`, the candidates (the shared head's end, each part
    followed by an assistant message after it, the prompt's end), the shared head's last part and
    the root part."""
    ends = [len(orjson.dumps(chat.get("tools") or []))]
    for message in chat["messages"]:
        ends.append(ends[-1] + len(orjson.dumps(message)))
    marks = [part for part, end in enumerate(ends) if end // chunk > (ends[part - 1] if part else 0) // chunk]
    last = len(ends) - 1
    users = [number for number, m in enumerate(chat["messages"], 1) if m["role"] == "user"]
    shared, root = (users[0] - 1, users[0]) if users else (last, last)
    candidates = ([shared] if users else []) + [
        number - 1 for number, m in enumerate(chat["messages"], 1) if m["role"] == "assistant" and users and number > users[0]
    ]
    if not candidates or candidates[-1] != last:
        candidates.append(last)
    return ends, marks, candidates, shared, root


def test_a_message_that_is_not_an_object_is_a_part_without_a_role() -> None:
    chat = {
        "messages": [{"role": "user", "content": "hi"}, "not an object", {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    }
    prompt = prompt_of(chat, 16)
    # The string is a part like any other; the assistant message after it still ends a prompt.
    assert len(prompt.ends) == 5 and prompt.candidates == [0, 2, 4]


@settings(deadline=None)
@given(st.lists(_message, max_size=10), st.sampled_from([16, 64, 256, 4096]), st.booleans())
def test_the_key_is_laid_out_as_defined(messages: list[dict[str, Any]], chunk: int, with_tools: bool) -> None:
    chat = {"messages": messages, **({"tools": TOOLS} if with_tools else {})}
    prompt = prompt_of(chat, chunk)
    ends, marks, candidates, shared, root = layout_by_definition(chat, chunk)
    assert (prompt.ends, prompt.chunk_marks, prompt.candidates, prompt.shared) == (ends, marks, candidates, shared)
    assert prompt.key.root == prompt.digests[root] and prompt.size == ends[-1]
    assert prompt.key.marks == tuple(prompt.digests[i] for i in sorted({*marks, shared, len(ends) - 1}))


@settings(deadline=None)
@given(st.lists(_message, min_size=1, max_size=8), st.data())
def test_prompts_share_a_match_up_to_their_shared_parts_and_none_past_a_difference(
    messages: list[dict[str, Any]], data: st.DataObject
) -> None:
    # Two prompts equal up to message `k` and differing in it (anywhere: one character of its
    # text, or its role), followed by anything.
    k = data.draw(st.integers(0, len(messages) - 1))
    original = messages[k]
    changed = data.draw(
        st.one_of(
            st.text().map(lambda text: {**original, "content": text}),
            st.sampled_from(["system", "user", "assistant", "tool"]).map(lambda role: {**original, "role": role}),
        ).filter(lambda message: orjson.dumps(message) != orjson.dumps(original))
    )
    tail = data.draw(st.lists(_message, max_size=3))
    chunk = data.draw(st.sampled_from([16, 64, 256]))
    one = prompt_of({"messages": messages, "tools": TOOLS}, chunk)
    other = prompt_of({"messages": [*messages[:k], changed, *tail], "tools": TOOLS}, chunk)
    # Parts 0..k (the tools and the first k messages) are the same, and so are their digests;
    # from the changed part on, every digest differs (each covers every byte before it).
    assert one.digests[: k + 1] == other.digests[: k + 1]
    assert not set(one.digests[k + 1 :]) & set(other.digests[k + 1 :])
    index = PrefixIndex(10000, ttl_s=1e9)
    index.record(1, "p", one.key)
    index.confirm(1, one.key)
    # Every chunk mark within the shared parts matches (they are the same marks), nothing past
    # the difference does; held says the same once confirmed.
    shared_chunks = max((other.ends[i] for i in other.chunk_marks if i <= k), default=0)
    assert shared_chunks <= index.match(1, other) <= other.ends[k]
    assert index.held(1, other) == index.match(1, other)


@settings(deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["record", "confirm"]), st.integers(0, 2), st.integers(0, 2), st.integers(1, 5)), max_size=20))
def test_held_from_the_sent_match_is_the_held_match(steps: list[tuple[str, int, int, int]]) -> None:
    # The router passes the endpoint's sent match to `held` to skip the search: it must answer
    # as the search does, whatever was recorded and confirmed before.
    index = PrefixIndex(12, ttl_s=1e9)
    for step, endpoint, session, turns in steps:
        key = prompt_of(conversation(session, turns), 512).key
        if step == "record":
            index.record(endpoint, "p", key)
        else:
            index.confirm(endpoint, key)
    for session in range(3):
        for turns in range(1, 7):
            prompt = prompt_of(conversation(session, turns), 512)
            for endpoint, sent in index.matches(range(3), prompt).items():
                assert index.held(endpoint, prompt, sent=sent) == index.held(endpoint, prompt) <= sent


def test_marks_are_few_and_bounded_by_the_chunk_size() -> None:
    chat = conversation(1, 12)
    for chunk in (512, 2048, 16384):
        prompt = prompt_of(chat, chunk)
        # One per chunk at most, plus the shared head's end and the prompt's end.
        assert len(prompt.key.marks) <= prompt.size // chunk + 2
    assert len(prompt_of(chat, 16384).key.marks) < len(chat["messages"]) // 4


# --- the index: bounded, LRU, aged, monotone ---------------------------------------------------------


# No deadline: the machine is shared, and a slow example is not a wrong one.
@settings(deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=30),
    st.integers(1, 60),
)
def test_memory_stays_bounded_per_endpoint(sends: list[tuple[int, int, int]], capacity: int) -> None:
    index = PrefixIndex(capacity, ttl_s=1e9)
    for endpoint, session, turns in sends:
        index.record(endpoint, "p", prompt_of(conversation(session, turns), 512).key)
        assert all(index.marks_held(e) <= capacity for e in range(4))
    endpoint, session, turns = sends[-1]
    last = prompt_of(conversation(session, turns), 512)
    if len(last.key.marks) <= capacity:
        assert index.match(endpoint, last) == last.size


@settings(deadline=None)
@given(st.integers(0, 6), st.integers(1, 6), st.sampled_from([256, 1024, 4096]))
def test_match_is_monotone_over_the_turns(session: int, turns: int, chunk: int) -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    prompt = prompt_of(conversation(session, turns), chunk)
    index.record(1, "p", prompt.key)
    # An earlier turn of the conversation matches up to its last chunk mark at least (its own
    # end was not recorded); a later one exactly as far as this one; held counts nothing until
    # the endpoint answered.
    for earlier in range(1, turns + 1):
        previous = prompt_of(conversation(session, earlier), chunk)
        assert 0 <= previous.size - index.match(1, previous) < chunk
    later = prompt_of(conversation(session, turns + 2), chunk)
    assert index.match(1, later) == prompt.size
    assert index.held(1, later) == 0
    index.confirm(1, prompt.key)
    assert index.held(1, later) == prompt.size


def test_lru_drops_the_least_recent_conversation_first() -> None:
    a, b, c = (prompt_of({"messages": [{"role": "user", "content": f"{n} " * 2000}]}, 256) for n in "abc")
    # Room for two of them: each has its own end mark and shares the head's (no tools).
    index = PrefixIndex(3, ttl_s=1e9)
    index.record(1, "p", a.key)
    index.record(1, "p", b.key)
    assert index.match(1, a) == a.size
    index.record(1, "p", a.key)  # a is now the most recent
    index.record(1, "p", c.key)
    assert index.match(1, a) == a.size
    assert index.match(1, b) == b.shared_bytes < b.size
    assert index.match(1, c) == c.size


def test_entries_age_out() -> None:
    clock = Clock()
    index = PrefixIndex(10000, ttl_s=60, clock=clock)
    prompt = prompt_of(conversation(1, 2), 256)
    index.record(1, "p", prompt.key)
    clock.now = 59
    assert index.match(1, prompt) == prompt.size
    clock.now = 61
    assert index.match(1, prompt) == 0
    index.record(2, "p", prompt.key)  # any write sweeps what has aged out at the old end
    other = prompt_of(conversation(2, 1), 256)
    index.record(1, "p", other.key)
    assert index.marks_held(1) == len(other.key.marks)


def test_forget_and_retain() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    prompt = prompt_of(conversation(1, 2), 256)
    for endpoint in (1, 2, 3):
        index.record(endpoint, "p", prompt.key)
    index.record(9, "other", prompt.key)
    index.forget(1)
    index.retain("p", [3])
    assert index.match(1, prompt) == index.match(2, prompt) == 0
    assert index.match(3, prompt) == index.match(9, prompt) == prompt.size


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
    placement = asyncio.run(router.place_generation(cluster or pool(), f"req-{len(taken)}", RenderedChat(chat), session=session))
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
        # The previous turn is held: everything but the new messages.
        earlier = prompt_of(conversation(1, turns - 1), 2048)
        assert later.matched_bytes == earlier.size
        assert later.match_length(1000) == 1000 * later.matched_bytes // later.prompt_bytes


def test_new_conversations_spread_evenly_and_processes_agree_on_the_pair(placed: list[Reservation]) -> None:
    chosen = {}
    for session in range(40):
        prompt = prompt_of(conversation(session, 1), 2048)
        chosen[session] = place(placed, conversation(session, 1)).reservation.endpoint.url
        placed[-1].release("success")
        # One of the conversation's two rendezvous endpoints: the same two in every process.
        assert chosen[session] in [e.url for e in router._rendezvous_ranked(prompt.root, list(GEN))[:2]]
    # Two choices by the conversations each serves: even, not as uneven as a hash alone.
    served = [list(chosen.values()).count(e.url) for e in GEN]
    assert max(served) - min(served) <= 2, served
    # A second process that saw the same conversations makes the same choices.
    get_index().retain("ca", [])
    for session in range(40):
        assert place(placed, conversation(session, 1)).reservation.endpoint.url == chosen[session]
        placed[-1].release("success")
    # ...and, having seen them, sends each next turn where it is.
    for session in range(40):
        assert place(placed, conversation(session, 2)).reservation.endpoint.url == chosen[session]
        placed[-1].release("success")


def test_a_new_conversation_goes_to_the_rendezvous_endpoint_serving_fewer_conversations(placed: list[Reservation]) -> None:
    session = "session-x"
    first, second = router._rendezvous_ranked(session.encode(), list(GEN))[:2]
    # An empty index: where session_affinity would send it.
    assert place(placed, conversation(50, 1), session=session).reservation.endpoint == first
    placed[-1].release("success")
    # Its first choice now serves one conversation more than its second: the next session of the
    # same pair goes to the second.
    get_index().retain("ca", [])
    get_index().record(first.id, "ca", prompt_of(conversation(51, 1), 2048).key)
    assert place(placed, conversation(50, 1), session=session).reservation.endpoint == second


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
    assert get_index().marks_held(home.id) > 0
    others = tuple(e for e in GEN if e != home)
    place(placed, conversation(4, 1), cluster=pool(*others))
    assert get_index().marks_held(home.id) == 0
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
    assert get_index().marks_held(placement.reservation.endpoint.id) == 0


CTX = [EndpointInfo(id=9200 + i, pool_name="ca", role="context", url=f"http://c{i}", enabled=True, draining=False, healthy=True) for i in range(2)]


def test_the_context_phase_goes_where_the_conversation_was_prefilled(placed: list[Reservation]) -> None:
    cluster = pool(*GEN, *CTX)
    first = place(placed, conversation(5, 1), cluster=cluster)
    context = asyncio.run(router.reserve(cluster, "context", "req-c", placement=first))
    placed.append(context)
    home, other = context.endpoint, next(c for c in CTX if c != context.endpoint)
    assert first.key is not None
    get_index().confirm(home.id, first.key)  # what the pipeline does on the context answer
    for turns in (2, 3, 4):
        # The conversation's context worker stays busier than the other (its earlier phase is
        # still open), within the load guard: the cache wins over the load.
        later = place(placed, conversation(5, turns), cluster=cluster)
        assert later.prompt is not None
        matches = get_index().matches([home.id, other.id], later.prompt)
        assert matches == {home.id: prompt_of(conversation(5, turns - 1), 2048).size, other.id: 0}
        again = asyncio.run(router.reserve(cluster, "context", f"req-c{turns}", placement=later))
        placed.append(again)
        assert again.endpoint == home
    # Another conversation with the same head: its context phase goes where the head is too.
    fresh = place(placed, conversation(6, 1), cluster=cluster)
    assert fresh.prompt is not None
    assert get_index().match(home.id, fresh.prompt) == fresh.prompt_bytes - len(orjson.dumps(conversation(6, 1)["messages"][-1]))
    head = asyncio.run(router.reserve(cluster, "context", "req-c6", placement=fresh))
    placed.append(head)
    assert head.endpoint == home


@override_settings(PREFIX_BALANCE_ABS_THRESHOLD=1, PREFIX_BALANCE_REL_THRESHOLD=1.0)
def test_an_overloaded_context_holder_is_skipped(placed: list[Reservation]) -> None:
    cluster = pool(*GEN, *CTX)
    first = place(placed, conversation(8, 1), cluster=cluster)
    home = asyncio.run(router.reserve(cluster, "context", "req-c", placement=first))
    placed.append(home)
    busy = asyncio.run(router.reserve(cluster, "context", "req-busy", exclude=[c.url for c in CTX if c != home.endpoint]))
    placed.append(busy)
    assert busy.endpoint == home.endpoint  # two open on home, none on the other: over the guard
    later = place(placed, conversation(8, 2), cluster=cluster)
    moved = asyncio.run(router.reserve(cluster, "context", "req-c2", placement=later))
    placed.append(moved)
    assert moved.endpoint != home.endpoint


def test_without_a_placement_the_context_phase_goes_to_the_least_loaded(placed: list[Reservation]) -> None:
    cluster = pool(*GEN, *CTX)
    first = place(placed, conversation(9, 1), cluster=cluster)
    home = asyncio.run(router.reserve(cluster, "context", "req-c", placement=first))
    placed.append(home)
    plain = asyncio.run(router.reserve(cluster, "context", "req-plain"))  # load 1 against 0
    placed.append(plain)
    assert plain.endpoint != home.endpoint


def test_a_conversation_keeps_one_end_mark_per_endpoint() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    for turns in range(1, 9):
        key = prompt_of(conversation(1, turns), 16384).key
        index.record(1, "p", key)
        index.confirm(1, key)
    last = prompt_of(conversation(1, 8), 16384)
    # Each turn's end mark replaced the one before: what is kept is this prompt's marks (its
    # chunk marks, the head's end and its end), not one per turn.
    assert index.marks_held(1) == len(last.key.marks) < 8
    assert index.match(1, prompt_of(conversation(1, 9), 16384)) == last.size
