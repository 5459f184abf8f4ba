"""Per-key prefix-cache isolation end to end: daphne in front of simulated workers with a prefix
cache, two keys sending the same long prompt. In a pool that keeps keys apart the second key is
told of no cache hit and the workers get a different `cache_salt` from each key; keys of one cache
group, or a pool that shares, get the hit. (The pieces: tests/unit/test_cache_isolation.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker

CACHED = {"kv_cache_blocks": 4096, "kv_block_tokens": 16}


def long_prompt() -> str:
    # New words each test: the sims' caches outlive a test.
    return f"{time.monotonic_ns()} " + " ".join(f"word{i}" for i in range(600))


def ask(gateway: Gateway, cluster: Cluster, key: str, system: str) -> dict[str, Any]:
    response = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": cluster.model, "max_tokens": 8, "system": system, "messages": [{"role": "user", "content": "Summarise. [sim tokens=2]"}]},
        headers={**cluster.headers(), "x-api-key": key},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


def salts(worker: SimWorker) -> list[str | None]:
    return [entry["body"].get("cache_salt") for entry in httpx.get(worker.url + "/sim/requests?headers=1", timeout=5).json()]


def new_key(name: str, cache_group: str = "") -> str:
    from messages_api.auth import create_api_key

    return create_api_key(f"{name}-{time.monotonic_ns()}", cache_group=cache_group)[1]


@pytest.fixture
def vllm_pool(
    transactional_db: Any, gateway: Gateway, sim_pair: Callable[..., tuple[SimWorker, SimWorker]]
) -> Callable[..., Cluster]:
    def make(**kw: Any) -> Cluster:
        cluster = register_cluster(*sim_pair("vllm", **CACHED), protocol="vllm", **kw)
        wait_registered(gateway, cluster)
        return cluster

    return make


@pytest.mark.parametrize("schedule_style", ["aggregated", "context_first"])
def test_a_pool_that_keeps_keys_apart_tells_no_key_of_anothers_prompt(
    gateway: Gateway, vllm_pool: Callable[..., Cluster], schedule_style: str
) -> None:
    cluster = vllm_pool(schedule_style=schedule_style)  # the default cache scope: per key
    system = long_prompt()
    alice, bob = cluster.key, new_key("bob")
    first = ask(gateway, cluster, alice, system)
    assert first["cache_read_input_tokens"] == 0
    # A key shares with itself: its second request reads the first one's prefix.
    again = ask(gateway, cluster, alice, system)
    assert again["cache_read_input_tokens"] > 0.5 * first["input_tokens"]
    other = ask(gateway, cluster, bob, system)
    assert other["cache_read_input_tokens"] == 0
    assert other["input_tokens"] == first["input_tokens"]  # nothing read, nothing hidden in the split
    # Every worker request carried its key's salt, on both legs, and the two keys' differ.
    legs = [cluster.generation] + ([cluster.context] if schedule_style == "context_first" else [])
    for worker in legs:
        sent = salts(worker)
        assert len(sent) == 3 and all(sent), sent
        assert sent[0] == sent[1] != sent[2]
    if schedule_style == "context_first":
        assert salts(cluster.context) == salts(cluster.generation)


def test_keys_of_one_cache_group_share_it(gateway: Gateway, vllm_pool: Callable[..., Cluster]) -> None:
    cluster = vllm_pool(schedule_style="aggregated")
    system = long_prompt()
    carol, dave = new_key("carol", "team-a"), new_key("dave", "team-a")
    first = ask(gateway, cluster, carol, system)
    assert ask(gateway, cluster, dave, system)["cache_read_input_tokens"] > 0.5 * first["input_tokens"]
    assert ask(gateway, cluster, cluster.key, system)["cache_read_input_tokens"] == 0  # not of the group
    sent = salts(cluster.generation)
    assert sent[0] == sent[1] != sent[2]


def test_a_shared_pool_reports_another_keys_hit_as_before(gateway: Gateway, vllm_pool: Callable[..., Cluster]) -> None:
    cluster = vllm_pool(schedule_style="aggregated", cache_scope="shared")
    system = long_prompt()
    first = ask(gateway, cluster, cluster.key, system)
    other = ask(gateway, cluster, new_key("erin"), system)
    assert other["cache_read_input_tokens"] > 0.5 * first["input_tokens"]
    assert salts(cluster.generation) == [None, None]


@pytest.mark.parametrize(("cache_scope", "reported"), [("key", False), ("shared", True)])
def test_an_engine_without_a_salt_reports_no_hit_where_keys_are_kept_apart(
    transactional_db: Any, gateway: Gateway, sim_pair: Callable[..., tuple[SimWorker, SimWorker]], cache_scope: str, reported: bool
) -> None:
    """A plain OpenAI-compatible server has no cache salt: its cache is shared whatever the pool
    says, so a pool that keeps keys apart reports no hit at all (the key's own included)."""
    cluster = register_cluster(*sim_pair("openai", **CACHED), protocol="openai", schedule_style="aggregated", cache_scope=cache_scope)
    wait_registered(gateway, cluster)
    system = long_prompt()
    first = ask(gateway, cluster, cluster.key, system)
    other = ask(gateway, cluster, new_key("frank"), system)
    assert (other["cache_read_input_tokens"] > 0.5 * first["input_tokens"]) is reported
    assert salts(cluster.generation) == [None, None]
    # The worker did reuse the prefix: only the report was withheld.
    assert httpx.get(cluster.generation.url + "/sim/prefix_cache", timeout=5).json()["cached_tokens"] > 0
