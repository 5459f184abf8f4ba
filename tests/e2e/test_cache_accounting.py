"""Cache accounting through a real gateway and the sim's prefix cache, read by the official SDK:
a conversation's second turn reads the first turn's prompt from the worker's cache, reports only
what is new as cache creation, and input + creation + read add up to the prompt's tokens."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.cluster import Cluster, register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.sdk import sdk_client, sdk_message
from tests.support.simworkers import SimWorker


def system(unique: str) -> list[dict[str, Any]]:
    """A system prompt no earlier test sent (the sims' caches live for the session)."""
    return [{"type": "text", "text": f"{unique}: you are a careful assistant. " * 40, "cache_control": {"type": "ephemeral"}}]


def turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with a breakpoint on its newest block, as Claude Code marks it."""
    *history, last = messages
    return [*history, {"role": last["role"], "content": [{"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}]}]


@pytest.fixture
def aggregated(transactional_db: Any, gateway: Gateway, sim_pair: Callable[..., tuple[SimWorker, SimWorker]]) -> Cluster:
    """Workers with a prefix cache; the generation worker prefills itself, so its cache holds the
    first turn."""
    cluster = register_cluster(*sim_pair("trtllm", kv_cache_blocks=4096), schedule_style="aggregated")
    wait_registered(gateway, cluster)
    return cluster


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_the_second_turn_reads_the_first_and_the_counts_add_up(gateway: Gateway, aggregated: Cluster, stream: bool) -> None:
    cluster = aggregated
    system_prompt = system(f"{uuid.uuid4().hex} {stream}")
    with sdk_client(gateway.url, cluster.key) as client:
        first_messages = [{"role": "user", "content": f"Tell me about caching ({stream}) [sim tokens=6]"}]
        first = sdk_message(client, stream, model=cluster.model, max_tokens=32, system=system_prompt, messages=turn(first_messages))
        prompt_1 = client.messages.count_tokens(model=cluster.model, system=system_prompt, messages=turn(first_messages)).input_tokens
        usage = first.usage
        assert usage.cache_read_input_tokens == 0
        assert usage.cache_creation_input_tokens is not None and usage.cache_creation_input_tokens > 0.9 * prompt_1
        total = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
        assert total == pytest.approx(prompt_1, rel=0.05)

        second_messages = [
            *first_messages,
            {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
            {"role": "user", "content": "And then? [sim tokens=4]"},
        ]
        second = sdk_message(client, stream, model=cluster.model, max_tokens=32, system=system_prompt, messages=turn(second_messages))
        prompt_2 = client.messages.count_tokens(model=cluster.model, system=system_prompt, messages=turn(second_messages)).input_tokens
    usage = second.usage
    assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens > 0.5 * prompt_1
    assert usage.cache_creation_input_tokens is not None and usage.cache_creation_input_tokens < prompt_2 - usage.cache_read_input_tokens + 1
    total = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    assert total == pytest.approx(prompt_2, rel=0.05)
