"""Operating the gateway: live registry changes, draining, health, failover, breakers, routing
policies, metrics — against real daphne processes and real sim workers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from django.core.management import call_command

from tests.support.cluster import (
    Cluster,
    audit_row,
    register_cluster,
    reservations_closed,
    sim_worker,
    wait_registered,
    wait_until,
)
from tests.support.gateway import Gateway
from tests.support.ports import refused_url
from tests.support.prometheus import metric_value
from tests.support.rawclient import RawStream
from tests.support.scripted import ScriptedServer, answering, response
from tests.support.simworkers import SimWorker
from workers.models import WorkerEndpoint

pytestmark = pytest.mark.django_db(transaction=True)

FAST_PROBES = {"HEALTH_CHECK_INTERVAL_S": "0.1", "HEALTH_CHECK_TIMEOUT_S": "0.5", "HEALTH_UNHEALTHY_AFTER": "2", "HEALTH_HEALTHY_AFTER": "2"}


@pytest.fixture(scope="module")
def second_generation_worker() -> Iterator[SimWorker]:
    yield from sim_worker("generation")


def post(gateway: Gateway, cluster: Cluster, text: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": cluster.model, "max_tokens": 16, "messages": [{"role": "user", "content": text}], **body}
    return httpx.post(gateway.url + "/v1/messages", json=payload, headers=cluster.headers(**(headers or {})), timeout=30)


def add_endpoint(cluster: Cluster, role: str, url: str) -> WorkerEndpoint:
    return WorkerEndpoint.objects.create(pool=cluster.pool, role=role, url=url)


def routed_generation(gateway: Gateway, cluster: Cluster, text: str = "hi [sim tokens=1]", **kw: Any) -> str:
    response = post(gateway, cluster, text, **kw)
    assert response.status_code == 200, response.text
    return audit_row(response.headers["request-id"]).generation_endpoint


def in_flight_generation_endpoint(request_id: str) -> str:
    from messages_api.models import MessageRequest

    return wait_until(
        lambda: MessageRequest.objects.filter(request_id=request_id).values_list("generation_endpoint", flat=True).first()
    )


@pytest.fixture
def make_cluster(transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker) -> Callable[..., Cluster]:
    def make(gateway: Gateway, **kw: Any) -> Cluster:
        cluster = register_cluster(context_worker, generation_worker, **kw)
        wait_registered(gateway, cluster)
        return cluster

    return make


# --- the live registry -------------------------------------------------------------------------------


def test_registered_endpoint_takes_traffic_within_two_seconds(
    gateway: Gateway, make_cluster: Callable[..., Cluster], second_generation_worker: SimWorker
) -> None:
    cluster = make_cluster(gateway)
    second_generation_worker.reset()
    call_command("register_worker", pool=cluster.pool.name, model=cluster.model, role="generation", url=second_generation_worker.url)
    call_command("register_worker", pool=cluster.pool.name, model=cluster.model, role="generation", url=second_generation_worker.url)
    assert WorkerEndpoint.objects.filter(pool=cluster.pool, role="generation").count() == 2  # idempotent
    seen = wait_until(
        lambda: routed_generation(gateway, cluster) == second_generation_worker.url, timeout=2.0, interval=0.05,
        message="a new endpoint was not routed to within 2 s",
    )
    assert seen


def test_draining_finishes_in_flight_and_takes_no_new(
    gateway: Gateway, make_cluster: Callable[..., Cluster], second_generation_worker: SimWorker
) -> None:
    cluster = make_cluster(gateway)
    second = add_endpoint(cluster, "generation", second_generation_worker.url)
    first = WorkerEndpoint.objects.get(pool=cluster.pool, role="generation", url=cluster.generation.url)
    wait_registered(gateway, cluster)
    # A long stream in flight on the first endpoint (round robin alternates the two).
    for _ in range(4):
        s = RawStream.post_json(
            gateway.url + "/v1/messages",
            {"model": cluster.model, "max_tokens": 4000, "stream": True, "messages": [{"role": "user", "content": "long [sim tokens=3000]"}]},
            cluster.headers(),
        )
        s.read_until("content_block_delta")
        if in_flight_generation_endpoint(s.response_headers["request-id"]) == first.url:
            break
        s.read_all()
    else:
        pytest.fail("no stream landed on the first endpoint")
    first.draining = True
    first.save()
    wait_until(lambda: routed_generation(gateway, cluster) == second.url, timeout=3)
    assert {routed_generation(gateway, cluster) for _ in range(4)} == {second.url}
    frames = s.read_all()
    assert frames[-1].event == "message_stop"  # the in-flight request finished on the draining endpoint
    assert audit_row(s.response_headers["request-id"]).status == "completed"


def test_disabled_endpoint_gets_nothing(gateway: Gateway, make_cluster: Callable[..., Cluster], second_generation_worker: SimWorker) -> None:
    cluster = make_cluster(gateway)
    add_endpoint(cluster, "generation", second_generation_worker.url)
    WorkerEndpoint.objects.filter(url=cluster.generation.url).update(enabled=False)
    wait_until(lambda: all(routed_generation(gateway, cluster) == second_generation_worker.url for _ in range(3)), timeout=3)


# --- health, failover, breakers ---------------------------------------------------------------------------


@pytest.fixture
def probing_gateway() -> Iterator[Gateway]:
    """A gateway that probes fast, stopped after the test so it probes no other test's endpoints."""
    with Gateway(FAST_PROBES) as gateway:
        yield gateway


def test_prober_marks_a_dead_endpoint_unhealthy_and_routing_avoids_it(probing_gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    gateway = probing_gateway
    cluster = make_cluster(gateway)
    dead = add_endpoint(cluster, "context", refused_url())
    wait_until(lambda: not WorkerEndpoint.objects.get(pk=dead.pk).healthy, timeout=5, message="dead endpoint never marked unhealthy")
    row = WorkerEndpoint.objects.get(pk=dead.pk)
    assert row.last_error and row.last_checked_at is not None and "127.0.0.1" not in row.last_error
    for _ in range(4):
        response = post(gateway, cluster, "hi [sim tokens=1]")
        assert response.status_code == 200
        assert audit_row(response.headers["request-id"]).context_endpoint == cluster.context.url
    # The only live context endpoint goes away too: nothing is left, so 529 with retry-after.
    WorkerEndpoint.objects.filter(pool=cluster.pool, role="context").exclude(pk=dead.pk).update(enabled=False)
    response = wait_until(lambda: (r := post(gateway, cluster, "hi")).status_code == 529 and r, timeout=3)
    assert response.json()["error"]["type"] == "overloaded_error"
    assert float(response.headers["retry-after"]) >= 1
    assert cluster.context.url not in response.text


def test_prober_marks_a_revived_endpoint_healthy(probing_gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    gateway = probing_gateway
    cluster = make_cluster(gateway)
    endpoint = WorkerEndpoint.objects.get(pool=cluster.pool, role="context")
    endpoint.healthy = False
    endpoint.save()
    wait_until(lambda: WorkerEndpoint.objects.get(pk=endpoint.pk).healthy, timeout=5, message="never marked healthy again")


def test_context_connection_failure_is_retried_once_elsewhere(gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster]) -> None:
    gateway = gateways()
    cluster = make_cluster(gateway)
    dead = add_endpoint(cluster, "context", refused_url())
    wait_registered(gateway, cluster)
    outcomes = []
    for _ in range(4):  # round robin reaches the dead endpoint within two requests
        response = post(gateway, cluster, "hi [sim tokens=2]")
        assert response.status_code == 200, response.text
        rows = reservations_closed(response.headers["request-id"])
        outcomes.append(sorted((r.endpoint_url == dead.url, r.outcome) for r in rows if r.stage == "context"))
    assert [(False, "success")] in outcomes
    assert [(False, "success"), (True, "failure")] in outcomes
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'gateway_worker_retries_total{stage="context"}' in metrics


def test_breaker_opens_on_generation_failures_without_blaming_context(gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster]) -> None:
    gateway = gateways(BREAKER_FAILURE_THRESHOLD="3", BREAKER_COOLDOWN_S="60")
    cluster = make_cluster(gateway)
    dead = add_endpoint(cluster, "generation", refused_url())
    wait_registered(gateway, cluster)
    failures = 0
    for _ in range(12):
        response = post(gateway, cluster, "hi [sim tokens=1]")
        failures += response.status_code != 200
        if response.status_code != 200:
            assert response.status_code == 503 and response.json()["error"]["type"] == "overloaded_error"
            assert dead.url not in response.text
    assert failures == 3  # then the breaker is open and the dead endpoint gets nothing more
    metrics = httpx.get(gateway.url + "/metrics").text
    assert metric_value(metrics, "gateway_breaker_state", endpoint=dead.url) == 2.0
    assert metric_value(metrics, "gateway_breaker_state", endpoint=cluster.context.url) == 0.0
    assert metric_value(metrics, "gateway_breaker_state", endpoint=cluster.generation.url) == 0.0


@pytest.mark.parametrize("distinct_keys", ["2", "1"])
def test_one_key_whose_prompts_make_the_worker_fail_does_not_shut_out_the_others(
    gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster], distinct_keys: str
) -> None:
    """Key A's prompt makes the generation worker answer 500, again and again. With the default
    rule (two distinct keys) key B is still served; counting every 500 (one key: the rule
    switched off) opens the breaker and B gets 529, which is what this test guards against."""
    from messages_api.auth import create_api_key

    gateway = gateways(BREAKER_FAILURE_THRESHOLD="3", BREAKER_COOLDOWN_S="60", BREAKER_DISTINCT_KEYS=distinct_keys)
    cluster = make_cluster(gateway)
    _, other_key = create_api_key(f"other-key-{distinct_keys}")
    statuses = [post(gateway, cluster, "this prompt breaks the worker [sim gen_status=500]").status_code for _ in range(6)]
    answered = post(gateway, cluster, "hi [sim tokens=1]", headers={"x-api-key": other_key})
    if distinct_keys == "2":
        assert statuses == [500] * 6  # each answered by the worker, none refused by a breaker
        assert answered.status_code == 200, answered.text
        metrics = httpx.get(gateway.url + "/metrics").text
        assert metric_value(metrics, "gateway_breaker_state", endpoint=cluster.generation.url) == 0.0
    else:
        assert statuses == [500, 500, 500, 529, 529, 529]
        assert answered.status_code == 529 and answered.json()["error"]["type"] == "overloaded_error"


# --- routing policies ------------------------------------------------------------------------------


def test_session_affinity_keeps_a_session_on_one_generation_endpoint(
    gateway: Gateway, make_cluster: Callable[..., Cluster], second_generation_worker: SimWorker
) -> None:
    cluster = make_cluster(gateway)
    cluster.pool.routing = "session_affinity"
    cluster.pool.save()
    add_endpoint(cluster, "generation", second_generation_worker.url)
    wait_registered(gateway, cluster)
    wait_until(lambda: len({routed_generation(gateway, cluster, headers={"X-Claude-Code-Session-Id": f"s{i}"}) for i in range(12)}) == 2, timeout=3)
    for session in ("alpha", "beta", "gamma"):
        targets = {routed_generation(gateway, cluster, headers={"X-Claude-Code-Session-Id": session}) for _ in range(4)}
        assert len(targets) == 1
        # The same session through Claude Code's metadata.user_id lands on the same endpoint.
        via_metadata = routed_generation(gateway, cluster, metadata={"user_id": f"user_abc_account_def_session_{session}"})
        assert {via_metadata} == targets


def test_conditional_disaggregation_skips_the_context_phase_for_short_prompts(gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(gateway, max_local_prefill_tokens=50)
    short = post(gateway, cluster, "short prompt [sim tokens=2]")
    assert short.status_code == 200
    row = audit_row(short.headers["request-id"])
    assert row.context_endpoint == "" and row.status == "completed"
    assert [r.stage for r in reservations_closed(row.request_id)] == ["generation"]
    assert cluster.context.stats()["received"] == 0
    long = post(gateway, cluster, "long prompt " + "word " * 100 + "[sim tokens=2]")
    assert long.status_code == 200
    assert audit_row(long.headers["request-id"]).context_endpoint == cluster.context.url
    assert cluster.context.stats()["received"] == 1


def test_metrics_and_readiness(gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(gateway)
    assert post(gateway, cluster, "hi [sim tokens=1]").status_code == 200
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(gateway.url + "/ready")
    assert ready.status_code == 200 and ready.json()["database"] == "ok"
    text = httpx.get(gateway.url + "/metrics").text
    for name in (
        'gateway_requests_total{stage="done",status="completed",stream="false"}',
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_context_phase_seconds_count",
        "gateway_open_streams",
        "gateway_open_reservations",
        'gateway_gc_pause_seconds_count{generation="2"}',
    ):
        assert name in text, name
    # Every reservation of the request above was released once: none a second time.
    assert metric_value(text, "gateway_duplicate_releases_total") == 0.0
    # The start-up heap was frozen once daphne ran (a full GC walking it stalled the loop ~30 ms).
    frozen = next(line for line in text.splitlines() if line.startswith("gateway_gc_frozen_objects "))
    assert float(frozen.split()[1]) > 10_000
    WorkerEndpoint.objects.filter(pool=cluster.pool, role="generation").update(enabled=False)
    wait_until(lambda: httpx.get(gateway.url + "/ready").status_code == 503, timeout=3)


def test_generation_first_with_a_dead_generation_worker_stops_the_prefill(gateway: Gateway, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(gateway, schedule_style="generation_first")
    WorkerEndpoint.objects.filter(pool=cluster.pool, role="generation").update(enabled=False)
    add_endpoint(cluster, "generation", refused_url())

    def only_the_dead_one_routable() -> bool:
        pool = httpx.get(gateway.url + "/ready").json()["pools"][cluster.pool.name]["generation"]
        return pool == {"registered": 2, "routable": 1}

    wait_until(only_the_dead_one_routable, timeout=3)
    response = post(gateway, cluster, "long prefill [sim context_delay=30]")
    assert response.status_code == 503 and response.json()["error"]["type"] == "overloaded_error"
    # The context worker saw its request aborted at once, not after its 30 s prefill.
    cluster.context.wait_for(lambda s: s["aborted"] == 1 and s["active"] == 0, timeout=5)
    rows = reservations_closed(response.headers["request-id"])
    assert {r.stage: r.outcome for r in rows} == {"context": "cancelled", "generation": "failure"}


@pytest.fixture
def bare_503_url() -> Iterator[str]:
    """A server that answers every request 503 with no body, like a proxy in front of a worker
    that is down."""
    with ScriptedServer(answering(lambda _: response(503, headers={"connection": "close"}))) as server:
        yield server.url


def test_a_bare_503_from_the_context_side_is_retried_elsewhere(
    gateways: Callable[..., Gateway], make_cluster: Callable[..., Cluster], bare_503_url: str
) -> None:
    gateway = gateways()
    cluster = make_cluster(gateway)
    bare = add_endpoint(cluster, "context", bare_503_url)
    wait_registered(gateway, cluster)
    retried = 0
    for _ in range(4):  # round robin reaches the bare-503 endpoint within two requests
        response = post(gateway, cluster, "hi [sim tokens=2]")
        assert response.status_code == 200, response.text
        rows = reservations_closed(response.headers["request-id"])
        retried += any(r.endpoint_url == bare.url and r.outcome == "failure" for r in rows)
    assert retried >= 1
