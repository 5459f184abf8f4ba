"""The simulator's prefix cache: the block cache itself (properties), and a real sim process
reporting cached tokens and KV events."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.simworkers import SimWorker, start_simworker
from workers.sim.prefix_cache import PrefixCache, block_hashes

tokens = st.lists(st.integers(min_value=0, max_value=49999), max_size=200)


@given(tokens, st.integers(min_value=1, max_value=16))
def test_block_hashes_are_chained(ids: list[int], block: int) -> None:
    hashes = block_hashes(ids, block)
    assert len(hashes) == len(ids) // block
    # A prefix's hashes are the prefix of the whole's: what makes a block reusable only after
    # every block before it matched.
    for cut in range(0, len(ids) + 1, max(block, 7)):
        assert block_hashes(ids[:cut], block) == hashes[: cut // block]


@given(st.lists(tokens, min_size=1, max_size=20), st.integers(min_value=1, max_value=8), st.integers(min_value=0, max_value=40))
def test_memory_is_bounded_and_matches_are_block_aligned_prefixes(prompts: list[list[int]], block: int, capacity: int) -> None:
    cache = PrefixCache(block, capacity)
    for ids in prompts:
        matched = cache.match(ids)
        assert matched % block == 0 and matched <= len(ids)
        cache.store(ids)
        assert cache.blocks_held <= capacity
    last = prompts[-1]
    # Just stored: the whole prompt's full blocks are there unless they alone overflow the cache.
    if len(last) // block <= capacity:
        assert cache.match(last, touch=False) == len(last) // block * block


@given(tokens, tokens)
def test_match_is_monotone_in_the_prompt(a: list[int], b: list[int]) -> None:
    cache = PrefixCache(4, 1000)
    cache.store(a + b)
    # Every prefix of a stored prompt matches up to its own full blocks; extending a prompt never
    # shortens its match.
    assert cache.match(a, touch=False) == len(a) // 4 * 4
    assert cache.match(a + [1, 2, 3, 4, 5], touch=False) >= cache.match(a, touch=False) - 0


def test_lru_evicts_the_least_recent_and_tails_before_heads() -> None:
    cache = PrefixCache(2, 4)
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    cache.store(first)
    cache.store(second)
    assert cache.match(first) == 4  # touched: `second` is now the least recent
    cache.store([9, 10])
    assert cache.match(first, touch=False) == 4
    # second lost its tail block first: its head is still reusable
    assert cache.match(second, touch=False) == 2
    cache.store([11, 12, 13, 14])
    assert cache.match(second, touch=False) == 0


def test_disabled_cache_never_matches() -> None:
    cache = PrefixCache(16, 0)
    cache.store(list(range(100)))
    assert cache.match(list(range(100))) == 0 and cache.blocks_held == 0


def test_kv_events_report_stored_and_removed_blocks() -> None:
    cache = PrefixCache(2, 2)
    cache.store([1, 2, 3, 4])
    cache.store([5, 6])
    log = cache.events_after(0)
    kinds = [e["type"] for e in log["events"]]
    assert kinds == ["stored", "stored", "removed"]
    stored = log["events"][0]["block_hashes"]
    assert log["events"][2]["block_hashes"] == [stored[1]]  # the tail of [1, 2, 3, 4]
    assert cache.events_after(log["last_seq"])["events"] == []


# --- a real simulated worker -------------------------------------------------------------------

WORDS = " ".join(f"w{i}" for i in range(400))


@pytest.fixture(scope="module")
def cached_generation() -> Iterator[SimWorker]:
    worker = start_simworker(
        "generation", tokens_per_second=0, kv_block_tokens=16, kv_cache_blocks=1000,
        local_prefill_tokens_per_second=100000,
    )
    yield worker
    worker.stop()


def _chat(worker: SimWorker, messages: list[dict[str, str]]) -> dict[str, object]:
    response = httpx.post(
        worker.url + "/v1/chat/completions",
        json={"model": "sim-model", "messages": messages, "max_tokens": 3},
        timeout=10,
    )
    response.raise_for_status()
    usage: dict[str, object] = response.json()["usage"]
    return usage


def test_a_sim_reports_the_prefix_it_reused(cached_generation: SimWorker) -> None:
    turn1 = [{"role": "system", "content": WORDS}, {"role": "user", "content": "first question"}]
    before = httpx.get(cached_generation.url + "/sim/prefix_cache").json()
    first = _chat(cached_generation, turn1)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    turn2 = turn1 + [{"role": "assistant", "content": "an answer " * 20}, {"role": "user", "content": "next"}]
    second = _chat(cached_generation, turn2)
    cached = second["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
    assert isinstance(cached, int) and cached % 16 == 0
    # Everything up to the end of turn 1's prompt, less its partial last block and the
    # assistant marker the template appended after the last message.
    assert int(first["prompt_tokens"]) - 32 <= cached < int(second["prompt_tokens"])  # type: ignore[call-overload]
    after = httpx.get(cached_generation.url + "/sim/prefix_cache").json()
    assert after["cached_tokens"] - before["cached_tokens"] == cached
    assert after["computed_tokens"] - before["computed_tokens"] == int(first["prompt_tokens"]) + int(second["prompt_tokens"]) - cached  # type: ignore[call-overload]
    probe = httpx.post(cached_generation.url + "/sim/prefix_cache/match", json={"messages": turn2}).json()
    assert probe["cached_tokens"] == probe["prompt_tokens"] // 16 * 16
    events = httpx.get(cached_generation.url + "/sim/kv_events", params={"after": before["last_seq"]}).json()
    assert [e["type"] for e in events["events"]] == ["stored", "stored"]
    assert sum(len(e["block_hashes"]) for e in events["events"]) == after["blocks_held"] - before["blocks_held"]
