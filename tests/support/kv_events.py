"""Test support for KV-cache events end to end: sim workers that publish vLLM's events, a
`cache_aware` vLLM pool of them, and what a gateway's `/metrics` says of them."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.support.cluster import MODEL, Cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.ports import unused_port
from tests.support.prometheus import metric_total, metric_value
from tests.support.simworkers import SimWorker, start_simworker

BLOCK = 16

#: A sim worker, and the addresses of its KV-event publisher and replay socket.
Engine = tuple[SimWorker, str, str]


def start_engine(host: str = "127.0.0.1", **options: Any) -> Engine:
    """A sim generation worker (vLLM's dialect unless `protocol=`) publishing its prefix cache's
    events (`kv_cache_blocks=` its capacity), listening (chat, metrics, events) on `host`."""
    pub, replay = f"tcp://{host}:{unused_port()}", f"tcp://{host}:{unused_port()}"
    sim = start_simworker(
        "generation", host=host, tokens_per_second=0, prefill_tokens_per_second=0, kv_block_tokens=BLOCK,
        kv_events=pub, kv_events_replay=replay, **{"kv_cache_blocks": 4096, "protocol": "vllm", **options},
    )  # fmt: skip
    return sim, pub, replay


def metrics(gateway: Gateway) -> str:
    """The gateway's `/metrics` (with its METRICS_TOKEN, if it has one: a gateway on another host)."""
    token = gateway.env.get("METRICS_TOKEN")
    response = httpx.get(gateway.url + "/metrics", headers={"authorization": f"Bearer {token}"} if token else {}, timeout=5)
    response.raise_for_status()
    return response.text


def kv(gateway: Gateway, sim: SimWorker, name: str, **labels: str) -> float | None:
    """The gateway's sample `name` for the sim's endpoint (None: none yet)."""
    try:
        return metric_value(metrics(gateway), name, endpoint=sim.url, **labels)
    except AssertionError:
        return None


def register_pool(gateways: list[Gateway], engines: list[Engine], algorithm: str = "sha256") -> Cluster:
    """A `cache_aware` aggregated vLLM pool of the engines, their events followed with `algorithm`
    (the engines' sha256, or `tokens`); returns once every gateway routes with it and trusts every
    engine's events."""
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(
        name=f"pool-{MODEL}", model=MODEL, schedule_style="aggregated", protocol="vllm", routing="cache_aware", cache_scope="shared"
    )
    for sim, pub, replay in engines:
        WorkerEndpoint.objects.create(
            pool=pool, role="generation", url=sim.url, kv_events_address=pub, kv_events_replay_address=replay, kv_block_size=BLOCK,
            kv_hash_algorithm=algorithm,
        )
    _, key = create_api_key(f"test-key-{time.monotonic_ns()}")
    cluster = Cluster(pool=pool, key=key, model=MODEL, context=engines[0][0], generation=engines[-1][0])
    for gateway in gateways:
        wait_registered(gateway, cluster)
        for sim, _, _ in engines:
            wait_until(
                lambda gateway=gateway, sim=sim: kv(gateway, sim, "gateway_kv_events_trusted", reason="") == 1.0,
                timeout=15, message="not subscribed",
            )  # fmt: skip
    return cluster


def turn(gateway: Gateway, cluster: Cluster, messages: list[dict[str, Any]]) -> str:
    """One turn of a coding agent's conversation (a shared system prompt); its answer's text."""
    body = {"model": cluster.model, "max_tokens": 8, "system": "You are a coding agent. " * 30, "messages": messages}
    response = httpx.post(gateway.url + "/v1/messages", json=body, headers=cluster.headers(), timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["content"][0]["text"])


def counter(gateway: Gateway, name: str) -> float:
    """A counter of the gateway's, summed over its labels (`gateway_kv_events_prompts_learned_total`)."""
    return metric_total(metrics(gateway), name)


def received(sim: SimWorker) -> int:
    """Chat requests the sim worker received."""
    return int(sim.stats()["received"])
