"""`cache_aware` routing and conditional disaggregation by uncached tokens, end to end: a real
daphne gateway, a context and two generation sims with prefix caches, Anthropic requests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster import MODEL, Cluster, audit_row, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker, start_simworker

# Caches on; a prompt's prefill is costed per uncached token (fast: tests wait for conditions).
CACHED_SIM = {
    "tokens_per_second": 2000, "prefill_tokens_per_second": 200000, "max_context_tokens": 32768,
    "kv_timeout": 30, "kv_block_tokens": 16, "kv_cache_blocks": 8192,
}
LOCAL_PREFILL_LIMIT = 1000
SYSTEM = "You are a careful coding agent working in a large repository. " * 150  # ~1,500 tokens


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, SimWorker]]:
    started = {
        "context": start_simworker("context", **CACHED_SIM),
        "context_b": start_simworker("context", **CACHED_SIM),
        "gen_a": start_simworker("generation", **CACHED_SIM),
        "gen_b": start_simworker("generation", **CACHED_SIM),
    }
    yield started
    for worker in started.values():
        worker.stop()


def register_cache_aware(
    gateway: Gateway, context: SimWorker, *generations: SimWorker, more_contexts: tuple[SimWorker, ...] = ()
) -> Cluster:
    """A `cache_aware` pool of these sims (as `register_cluster`, which makes round-robin pools:
    changing the policy afterwards would race the gateway's registry refresh)."""
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(
        name=f"pool-{MODEL}", model=MODEL, routing="cache_aware", max_local_prefill_tokens=LOCAL_PREFILL_LIMIT
    )
    for worker in (context, *more_contexts):
        WorkerEndpoint.objects.create(pool=pool, role="context", url=worker.url)
    for worker in (context, *more_contexts, *generations):
        worker.reset()
    for worker in generations:
        WorkerEndpoint.objects.create(pool=pool, role="generation", url=worker.url)
    _, key = create_api_key(f"test-key-{time.monotonic_ns()}")
    cluster = Cluster(pool=pool, key=key, model=MODEL, context=context, generation=generations[0])
    wait_registered(gateway, cluster)
    return cluster


@pytest.fixture
def cluster(transactional_db: Any, gateway: Gateway, sims: dict[str, SimWorker]) -> Cluster:
    return register_cache_aware(gateway, sims["context"], sims["gen_a"], sims["gen_b"])


class Session:
    """A Claude Code-like conversation: a long shared system prompt, turns that append."""

    def __init__(self, gateway: Gateway, cluster: Cluster, name: str, *, header: bool) -> None:
        self.gateway, self.cluster, self.name, self.header = gateway, cluster, name, header
        self.messages: list[dict[str, Any]] = []
        # Its own system prompt: what other tests left in the sims' caches is not its.
        self.system = f"[{name}] " + SYSTEM

    def turn(self, words: int) -> tuple[httpx.Response, Any]:
        self.messages.append({"role": "user", "content": f"{self.name} asks: " + "please look at this file " * (words // 5)})
        headers = self.cluster.headers(**({"x-claude-code-session-id": self.name} if self.header else {}))
        body = {"model": self.cluster.model, "max_tokens": 8, "system": self.system, "messages": self.messages}
        response = httpx.post(self.gateway.url + "/v1/messages", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        answer = response.json()
        self.messages.append({"role": "assistant", "content": answer["content"]})
        return response, audit_row(response.headers["request-id"])


def prefix_cache(worker: SimWorker) -> Any:
    return httpx.get(worker.url + "/sim/prefix_cache", timeout=10).json()


def generation_urls(sims: dict[str, SimWorker]) -> dict[str, str]:
    return {sims["gen_a"].url: "gen_a", sims["gen_b"].url: "gen_b"}


@pytest.mark.parametrize("header", [False, True], ids=["no-session-header", "session-header"])
def test_a_second_turn_lands_on_the_holder_and_skips_the_context_phase(
    gateway: Gateway, cluster: Cluster, sims: dict[str, SimWorker], header: bool
) -> None:
    session = Session(gateway, cluster, f"conv-{header}", header=header)
    first, row1 = session.turn(50)
    # No endpoint held anything of it: TensorRT-LLM's rule needs the context phase.
    assert row1.context_endpoint == cluster.context.url and row1.status == "completed"
    home = row1.generation_endpoint
    assert home in generation_urls(sims)
    assert first.json()["usage"]["cache_read_input_tokens"] == 0

    second, row2 = session.turn(40)
    # The same endpoint, no context phase: its few new tokens were prefilled there.
    assert row2.generation_endpoint == home
    assert row2.context_endpoint == "" and row2.context_done_ms is None
    usage = second.json()["usage"]
    prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= first.json()["usage"]["input_tokens"] - 32
    assert row2.input_tokens == usage["input_tokens"] < prompt_tokens // 5
    holder = sims[generation_urls(sims)[home]]
    last = holder.requests()[-1]
    assert "disaggregated_params" not in last and last["messages"][-1]["content"].startswith(session.name)

    # Many new tokens: over the threshold of uncached tokens, the context phase runs again,
    # and the generation side stays where the conversation is.
    third, row3 = session.turn(LOCAL_PREFILL_LIMIT * 3)
    assert row3.context_endpoint == cluster.context.url
    assert row3.generation_endpoint == home


def test_a_restarted_worker_loses_its_index_entries(
    gateway: Gateway, cluster: Cluster, sims: dict[str, SimWorker]
) -> None:
    session = Session(gateway, cluster, "restarting", header=False)
    _, row1 = session.turn(50)
    _, row2 = session.turn(30)
    home = row2.generation_endpoint
    assert row2.context_endpoint == "" and row1.generation_endpoint == home
    name = generation_urls(sims)[home]
    worker = sims[name]
    worker.stop()

    # The gateway finds it gone (a connection refused): the request fails, and with it what the
    # index said the worker held.
    session.messages.append({"role": "user", "content": "while it was down"})
    failed = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": cluster.model, "max_tokens": 8, "system": session.system, "messages": session.messages},
        headers=cluster.headers(), timeout=30,
    )
    assert failed.status_code >= 500
    session.messages.pop()

    restarted = sims[name] = start_simworker("generation", port=worker.port, **CACHED_SIM)
    try:
        # A turn with few new tokens that would have skipped the context phase: the index no
        # longer claims a match there, so the context phase runs (TensorRT-LLM's match 0 rule).
        third, row3 = session.turn(30)
        assert row3.generation_endpoint == home  # the rendezvous choice, as for the first turn
        assert row3.context_endpoint == cluster.context.url
        assert third.json()["usage"]["cache_read_input_tokens"] == 0
        # ...and the index learns again from there.
        _, row4 = session.turn(30)
        assert row4.context_endpoint == "" and row4.generation_endpoint == home
    finally:
        wait_until(lambda: restarted.stats()["active"] == 0)


def test_a_silent_restart_is_learnt_from_the_workers_cached_tokens(
    transactional_db: Any, gateway: Gateway, sims: dict[str, SimWorker]
) -> None:
    """A restart no request and no probe saw: the worker's own usage (no cached tokens where the
    index expected some) makes the gateway forget what it credited the worker with."""
    cluster = register_cache_aware(gateway, sims["context"], sims["gen_b"])
    a = Session(gateway, cluster, "silent-a", header=False)
    b = Session(gateway, cluster, "silent-b", header=False)
    for session in (a, b):
        session.turn(50)
        _, row = session.turn(30)
        assert row.context_endpoint == ""
    worker = sims["gen_b"]
    worker.stop()
    restarted = sims["gen_b"] = start_simworker("generation", port=worker.port, **CACHED_SIM)

    # The index still credits the worker with conversation a: no context phase, and the worker
    # says it had nothing cached...
    answer, row_a = a.turn(30)
    assert row_a.context_endpoint == ""
    assert answer.json()["usage"]["cache_read_input_tokens"] == 0
    # ...so conversation b, which the gateway has not sent since, is no longer credited either.
    _, row_b = b.turn(30)
    assert row_b.context_endpoint == cluster.context.url
    # The index learns again from there.
    _, row_a = a.turn(30)
    assert row_a.context_endpoint == ""
    wait_until(lambda: restarted.stats()["active"] == 0)


def test_a_context_phase_goes_to_the_context_worker_holding_the_conversation(
    transactional_db: Any, gateway: Gateway, sims: dict[str, SimWorker]
) -> None:
    """Each turn with many new tokens needs a context phase; it goes where the conversation's
    earlier context phases went, which prefills only the new tokens."""
    cluster = register_cache_aware(gateway, sims["context"], sims["gen_a"], more_contexts=(sims["context_b"],))
    contexts = {sims["context"].url: sims["context"], sims["context_b"].url: sims["context_b"]}
    session = Session(gateway, cluster, "long-turns", header=False)
    _, first = session.turn(LOCAL_PREFILL_LIMIT * 2)
    home = first.context_endpoint
    assert home in contexts
    for _ in range(3):
        before = prefix_cache(contexts[home])
        answer, row = session.turn(LOCAL_PREFILL_LIMIT * 2)
        assert row.context_endpoint == home
        after = prefix_cache(contexts[home])
        # The context worker reused the conversation so far: it computed about the new turn only.
        computed = after["computed_tokens"] - before["computed_tokens"]
        assert (
            after["cached_tokens"] - before["cached_tokens"]
            >= row.input_tokens + answer.json()["usage"]["cache_read_input_tokens"] - LOCAL_PREFILL_LIMIT * 3
        )
        assert computed < LOCAL_PREFILL_LIMIT * 3
