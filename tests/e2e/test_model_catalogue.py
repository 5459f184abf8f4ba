"""The model catalogue: public names (exact or patterns) routed to pools in preference order, the
name the workers get, discovery through /v1/models, and spill-over to the next pool when the first
is full or drained — against a real gateway and real sim workers."""

from __future__ import annotations

import io
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from django.core.management import call_command

from tests.support.cluster import Cluster, audit_row, register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker
from workers.cluster.registry import ClusterSnapshot, PoolInfo, RouteInfo
from workers.models import WorkerEndpoint, WorkerPool

HOLD = "[sim gen_delay=2 tokens=3]"


def route(*args: str, **options: Any) -> str:
    out = io.StringIO()
    call_command("model_route", *args, stdout=out, **options)
    return out.getvalue()


def ask(gateway: Gateway, cluster: Cluster, model: str, text: str = "hi [sim tokens=2]") -> httpx.Response:
    body = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    return httpx.post(gateway.url + "/v1/messages", json=body, headers=cluster.headers(), timeout=30)


@pytest.fixture
def cluster_with_routes(transactional_db: Any, gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker) -> Cluster:
    cluster = register_cluster(context_worker, generation_worker, schedule_style="generation_first")
    route("claude-sonnet-4-6", pool=[cluster.pool.name], display_name="Sonnet (simulated)")
    route("claude-haiku-*", pool=[cluster.pool.name], upstream_model="served-as-this")
    wait_registered(gateway, cluster)
    return cluster


def test_claude_names_reach_the_pool_under_the_workers_model_name(gateway: Gateway, cluster_with_routes: Cluster) -> None:
    cluster = cluster_with_routes
    wait_until(lambda: ask(gateway, cluster, "claude-sonnet-4-6").status_code == 200, message="route never seen")
    answer = ask(gateway, cluster, "claude-sonnet-4-6", "exact [sim tokens=2]").json()
    assert answer["model"] == "claude-sonnet-4-6"  # the client's name, in the answer
    sent = [r for r in cluster.generation.requests() if "exact [sim" in str(r.get("messages"))][-1]
    assert sent["model"] == cluster.model  # the pool's own model name, to its workers
    assert ask(gateway, cluster, "claude-haiku-4-5-20251001", "pattern [sim tokens=2]").status_code == 200
    sent = [r for r in cluster.generation.requests() if "pattern [sim" in str(r.get("messages"))][-1]
    assert sent["model"] == "served-as-this"
    unknown = ask(gateway, cluster, "claude-opus-4-8")
    assert unknown.status_code == 404 and unknown.json()["error"] == {"type": "not_found_error", "message": "model: claude-opus-4-8"}


def test_v1_models_lists_the_exact_names_with_display_names(gateway: Gateway, cluster_with_routes: Cluster) -> None:
    cluster = cluster_with_routes

    def listed() -> list[dict[str, Any]]:
        return httpx.get(gateway.url + "/v1/models", headers=cluster.headers(), timeout=10).json()["data"]

    models = wait_until(lambda: listed() if any(m["id"] == "claude-sonnet-4-6" for m in listed()) else None, message="not listed")
    by_id = {m["id"]: m for m in models}
    assert by_id["claude-sonnet-4-6"]["display_name"] == "Sonnet (simulated)"
    assert cluster.model in by_id  # a pool's own model stays a public name
    assert not any("*" in m for m in by_id)  # patterns are routes, not models
    one = httpx.get(gateway.url + "/v1/models/claude-sonnet-4-6", headers=cluster.headers(), timeout=10).json()
    assert one["type"] == "model" and one["display_name"] == "Sonnet (simulated)"


@pytest.fixture
def two_pools(
    transactional_db: Any,
    gateways: Callable[..., Gateway],
    context_worker: SimWorker,
    generation_worker: SimWorker,
    sim_pair: Callable[..., tuple[SimWorker, SimWorker]],
) -> tuple[Gateway, Cluster, WorkerPool]:
    gateway = gateways(ADMISSION_QUEUE_TIMEOUT_S="8")
    first = register_cluster(context_worker, generation_worker, schedule_style="generation_first", generation_capacity=1)
    context, generation = sim_pair("trtllm")
    second = WorkerPool.objects.create(
        name="spare", model="spare-model", schedule_style="generation_first", handoff_signing_key=first.pool.handoff_signing_key
    )
    WorkerEndpoint.objects.create(pool=second, role="context", url=context.url)
    WorkerEndpoint.objects.create(pool=second, role="generation", url=generation.url)
    route("claude-sonnet-4-6", pool=[first.pool.name, second.name])
    wait_registered(gateway, first)
    wait_until(lambda: "spare" in httpx.get(gateway.url + "/ready", timeout=5).json()["pools"], message="second pool unseen")
    # The route is a row of its own: a snapshot loaded between the pools and the route has both
    # pools and no route yet (a request would get 404), so wait for the route too.
    wait_until(
        lambda: httpx.get(gateway.url + "/v1/models/claude-sonnet-4-6", headers=first.headers(), timeout=5).status_code == 200,
        message="route unseen",
    )
    return gateway, first, second


def test_a_full_first_pool_spills_to_the_next(two_pools: tuple[Gateway, Cluster, WorkerPool]) -> None:
    gateway, first, second = two_pools
    holder = RawStream.post_json(
        gateway.url + "/v1/messages",
        {"model": "claude-sonnet-4-6", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": f"hold {HOLD}"}]},
        first.headers(),
    )
    holder.read_head()
    spilled = ask(gateway, first, "claude-sonnet-4-6")
    assert spilled.status_code == 200
    assert audit_row(holder.response_headers["request-id"], terminal=False).pool_name == first.pool.name
    assert audit_row(spilled.headers["request-id"]).pool_name == "spare"
    holder.read_all()
    again = ask(gateway, first, "claude-sonnet-4-6")
    assert audit_row(again.headers["request-id"]).pool_name == first.pool.name  # the first is preferred again


def test_a_drained_first_pool_sends_everything_to_the_next(two_pools: tuple[Gateway, Cluster, WorkerPool]) -> None:
    gateway, first, second = two_pools
    WorkerEndpoint.objects.filter(pool=first.pool).update(draining=True)
    wait_until(
        lambda: httpx.get(gateway.url + "/ready", timeout=5).json()["pools"][first.pool.name]["generation"]["routable"] == 0,
        message="drain never seen",
    )
    pools = {audit_row(ask(gateway, first, "claude-sonnet-4-6").headers["request-id"]).pool_name for _ in range(3)}
    assert pools == {"spare"}


def test_the_command_lists_and_deletes_routes(transactional_db: Any) -> None:
    pool = WorkerPool.objects.create(name="p", model="m")
    assert route("claude-*", pool=["p"]).strip() == "claude-*: p"
    assert "claude-*: p" in route(list=True)
    assert route("claude-*", delete=True).strip() == "deleted: claude-*"
    assert route(list=True) == ""
    assert pool.routes.count() == 0


def _pool(pool_id: int, model: str) -> PoolInfo:
    return PoolInfo(
        id=pool_id, name=f"p{pool_id}", model=model, schedule_style="aggregated", max_local_prefill_tokens=0,
        routing="round_robin", protocol="openai", created_at=datetime.now(timezone.utc),
    )


def test_resolution_order_exact_then_own_model_then_the_most_specific_pattern() -> None:
    now = datetime.now(timezone.utc)
    snapshot = ClusterSnapshot(
        pools=(_pool(1, "m1"), _pool(2, "claude-sonnet-4-6"), _pool(3, "m3")),
        loaded_at=0,
        routes=(
            RouteInfo("claude-*", "", "", (3,), now, is_pattern=True),
            RouteInfo("claude-sonnet-*", "", "big", (1, 3), now, is_pattern=True),
            RouteInfo("claude-opus-4-8", "Opus", "", (1,), now),
        ),
    )
    assert [(s.pool.id, s.upstream_model) for s in snapshot.serving("claude-opus-4-8")] == [(1, "m1")]
    assert [s.pool.id for s in snapshot.serving("claude-sonnet-4-6")] == [2]  # a pool's own model beats patterns
    assert [(s.pool.id, s.upstream_model) for s in snapshot.serving("claude-sonnet-5")] == [(1, "big"), (3, "big")]
    assert [s.pool.id for s in snapshot.serving("claude-haiku-4-5")] == [3]
    assert snapshot.serving("gpt-4") == ()
    assert [name for name, _, _ in snapshot.public_models()] == ["claude-opus-4-8", "m1", "claude-sonnet-4-6", "m3"]
