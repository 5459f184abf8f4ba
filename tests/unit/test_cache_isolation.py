"""Per-key prefix-cache isolation, piece by piece: the salt a key gets, what each engine's dialect
sends with it, the gateway's prefix index kept apart by it, the simulated cache honouring it, and
the cached-token count hidden where an engine cannot keep tenants apart. End to end:
tests/e2e/test_cache_isolation.py."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.test import override_settings

from messages_api.auth import cache_salt, hash_key
from workers.protocols import PROTOCOLS
from workers.protocols.base import AGGREGATED, CONTEXT_FIRST, GENERATION_FIRST, Call, ContextPeer
from workers.protocols.trtllm import ContextResult
from workers.protocols.vllm import PrefillResult
from workers.routing.prefix_index import PrefixIndex, Prompt
from workers.schedule.cache_feedback import hide_cached_tokens
from workers.schedule.rendered_chat import RenderedChat
from workers.sim.prefix_cache import PrefixCache, block_hashes

SALT = "tenant-salt-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
CHAT: dict[str, Any] = {
    "model": "m",
    "max_tokens": 16,
    # A client's (or a converter's) own field must never reach a worker as the salt.
    "cache_salt": "chosen-by-the-client",
    "messages": [{"role": "system", "content": "You are terse. " * 100}, {"role": "user", "content": "hi"}],
}
PEER = ContextPeer(url="http://ctx:8001", options={"bootstrap_port": 8998}, info={"ctx_info_endpoint": "tcp://ctx:9"})
HANDOFFS: dict[str, Any] = {
    "trtllm": ContextResult({"ctx_request_id": 1, "disagg_request_id": 1}, [1, 2], 2, None),
    "vllm": PrefillResult({"remote_engine_id": "e", "remote_block_ids": [1]}, 2),
}


# --- the key's salt -------------------------------------------------------------------------------


def test_a_keys_salt_is_its_own_and_its_groups_is_shared() -> None:
    alice, bob = cache_salt(1), cache_salt(2)
    assert alice != bob and alice == cache_salt(1)
    # 256 bits, unpadded base64url: what vLLM asks of a salt.
    assert len(alice) == 43 and alice.replace("-", "").replace("_", "").isalnum()
    team = cache_salt(1, "team-a")
    assert team == cache_salt(2, "team-a") != cache_salt(3, "team-b")
    assert team not in (alice, bob)


def test_the_salt_comes_from_the_secret_key_not_the_api_key() -> None:
    before = cache_salt(1)
    with override_settings(SECRET_KEY="another-deployment"):
        assert cache_salt(1) != before
    # Nothing a worker sees is the key or its hash.
    assert hash_key("sk-gw-x")[:8] not in before


# --- the dialects ------------------------------------------------------------------------------------


def legs(name: str, call: Call) -> list[dict[str, Any]]:
    """Every worker request the protocol builds for one chat request, in each schedule it runs."""
    protocol = PROTOCOLS[name]
    bodies = [protocol.aggregated_request(dict(CHAT), call)]
    for style in protocol.schedules - {AGGREGATED}:
        bodies.append(protocol.context_request(dict(CHAT), call, pair_id=7, schedule_style=style, context=PEER))
        if style == CONTEXT_FIRST:
            bodies.append(protocol.generation_request_after_context(dict(CHAT), call, HANDOFFS[name]))
        if style == GENERATION_FIRST:
            bodies.append(protocol.generation_request_first(dict(CHAT), call, pair_id=7, context=PEER, schedule_style=style))
    return bodies


@pytest.mark.parametrize("name", ["vllm", "sglang", "trtllm"])
def test_engines_with_a_salt_get_the_tenants_on_every_leg(name: str) -> None:
    bodies = legs(name, Call(request_id="r", cache_salt=SALT))
    assert len(bodies) >= 3
    assert [b["cache_salt"] for b in bodies] == [SALT] * len(bodies)
    # A pool whose keys share the cache sends no salt, and never the client's.
    assert all("cache_salt" not in b for b in legs(name, Call(request_id="r")))


def test_a_plain_openai_server_gets_no_salt() -> None:
    assert PROTOCOLS["openai"].cache_salt_field is None
    [body] = legs("openai", Call(request_id="r", cache_salt=SALT))
    assert "cache_salt" not in body


def test_the_salt_stays_out_of_the_calls_repr() -> None:
    assert SALT not in repr(Call(request_id="r", cache_salt=SALT))


# --- the gateway's prefix index ---------------------------------------------------------------------


def prompt(chat: dict[str, Any], salt: int = 0) -> Prompt:
    return Prompt(RenderedChat(chat), 256, salt=salt)


def test_one_tenants_prompt_neither_steers_nor_shortcuts_anothers() -> None:
    index = PrefixIndex(10000, ttl_s=1e9)
    alice, bob = 11, 22
    sent = prompt(CHAT, alice)
    index.record(1, "p", sent.key)
    index.confirm(1, sent.key)
    later = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]}
    assert index.match(1, prompt(later, alice)) > prompt(later, alice).shared_bytes
    assert index.held(1, prompt(later, alice)) > 0
    # The same bytes under another tenant (or the shared cache) match nothing there.
    for other in (bob, 0):
        assert index.match(1, prompt(later, other)) == 0 and index.held(1, prompt(later, other)) == 0
        assert prompt(later, other).root != prompt(later, alice).root
    # Unsalted, as before: the shared cache is one tenant.
    shared = prompt(CHAT)
    index.record(2, "p", shared.key)
    assert index.match(2, prompt(later)) > 0 and shared.key == Prompt(RenderedChat(CHAT), 256).key


# --- the simulated cache -----------------------------------------------------------------------------


def test_the_sim_salts_its_first_block_as_vllm_does() -> None:
    ids = list(range(64))
    assert block_hashes(ids, 16, "a")[0] != block_hashes(ids, 16, "b")[0] != block_hashes(ids, 16)[0]
    assert block_hashes(ids[:32], 16, "a") == block_hashes(ids, 16, "a")[:2]  # still a chain
    cache = PrefixCache(16, 100)
    cache.store(ids, salt="a")
    assert cache.match(ids, salt="a") == 64
    assert cache.match(ids, salt="b") == 0 and cache.match(ids) == 0


# --- what the client is told ---------------------------------------------------------------------------


def test_a_hit_the_engine_cannot_attribute_is_reported_as_none() -> None:
    chunk: dict[str, Any] = {"usage": {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 512}}}
    hide_cached_tokens(chunk)
    assert chunk["usage"] == {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 0}}
    for shape in ({}, {"usage": None}, {"usage": {"prompt_tokens": 1}}, {"usage": {"prompt_tokens_details": None}}):
        hide_cached_tokens(shape)  # nothing to hide, nothing added


# --- the operators' commands -----------------------------------------------------------------------


@pytest.mark.django_db
def test_register_worker_sets_the_pools_scope_and_a_new_pool_keeps_keys_apart() -> None:
    from django.core.management import call_command

    from workers.models import WorkerPool

    def register(*extra: str) -> None:
        call_command("register_worker", "--pool", "p", "--model", "m", "--role", "generation", "--url", "http://10.0.0.9:8000", *extra)

    register()
    assert WorkerPool.objects.get(name="p").cache_scope == "key"
    register("--cache-scope", "shared")
    assert WorkerPool.objects.get(name="p").cache_scope == "shared"


@pytest.mark.django_db
def test_a_replaced_key_keeps_its_cache_group() -> None:
    from django.core.management import call_command

    from messages_api.models import ApiKey

    call_command("create_api_key", "alice", "--cache-group", "team-a", stdout=io.StringIO(), stderr=io.StringIO())
    call_command("create_api_key", "alice", "--replace", stdout=io.StringIO(), stderr=io.StringIO())
    assert ApiKey.objects.get(name="alice").cache_group == "team-a"
    call_command("create_api_key", "alice", "--replace", "--cache-group", "", stdout=io.StringIO(), stderr=io.StringIO())
    assert ApiKey.objects.get(name="alice").cache_group == ""
