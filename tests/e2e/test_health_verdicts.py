"""What a probe's verdict may do to routing, against a real daphne gateway and real sim workers:
a worker whose /health answers late while it serves (an engine whose health route waits behind
its busy loop, as the soak's sim did under CPU starvation) is still routed to; a role with no
endpoint left says in the gateway's log why each one was left out, once, and never to the client."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, audit_row, register_cluster, reservations_closed, sim_worker, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.ports import refused_url
from tests.support.prometheus import metric_value
from tests.support.scripted import Request, ScriptedServer, answering, json_response
from tests.support.scripted import response as scripted_response
from tests.support.simworkers import SimWorker
from workers.models import WorkerEndpoint

pytestmark = pytest.mark.django_db(transaction=True)

# Probes every 0.1 s that give up after 1 s, two failures to be unhealthy; a late /health is 3 s
# late, an answer in time half the timeout: margins a loaded machine does not eat.
FAST_PROBES = {"HEALTH_CHECK_INTERVAL_S": "0.1", "HEALTH_CHECK_TIMEOUT_S": "1", "HEALTH_UNHEALTHY_AFTER": "2", "HEALTH_HEALTHY_AFTER": "2"}
LATE_S = 3.0


# Workers of this module's own: a late /health must not reach another module's tests.
@pytest.fixture(scope="module")
def own_context_worker() -> Iterator[SimWorker]:
    yield from sim_worker("context")


@pytest.fixture(scope="module")
def own_generation_worker() -> Iterator[SimWorker]:
    yield from sim_worker("generation")


@pytest.fixture
def probing_gateway() -> Iterator[Gateway]:
    """A gateway that probes fast, stopped after the test so it probes no other test's endpoints."""
    with Gateway(FAST_PROBES) as gateway:
        yield gateway


@pytest.fixture
def cluster(transactional_db: Any, own_context_worker: SimWorker, own_generation_worker: SimWorker) -> Iterator[Cluster]:
    cluster = register_cluster(own_context_worker, own_generation_worker)
    yield cluster
    own_context_worker.health_delay(0)
    own_generation_worker.health_delay(0)


def post(gateway: Gateway, cluster: Cluster, text: str = "hi [sim tokens=2]") -> httpx.Response:
    payload = {"model": cluster.model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    return httpx.post(gateway.url + "/v1/messages", json=payload, headers=cluster.headers(), timeout=30)


def endpoint(cluster: Cluster, role: str, url: str | None = None) -> WorkerEndpoint:
    return WorkerEndpoint.objects.get(pool=cluster.pool, role=role, **({"url": url} if url else {}))


def test_a_worker_whose_health_answers_late_while_it_serves_still_gets_requests(probing_gateway: Gateway, cluster: Cluster) -> None:
    gateway = probing_gateway
    wait_registered(gateway, cluster)
    # Both workers' /health answer after 3 s, past the probe's 1 s; their chat routes answer at
    # once. Each role has one endpoint: today the role then has nothing usable and every
    # request is refused "no generation worker is available" although the worker is up.
    cluster.generation.health_delay(LATE_S)
    cluster.context.health_delay(LATE_S)
    for role in ("generation", "context"):
        wait_until(lambda role=role: not endpoint(cluster, role).healthy, timeout=10, message=f"the {role} endpoint never marked unhealthy")
    # Readiness agrees with routing (a load balancer checking /ready would otherwise take every
    # gateway out for a worker that serves).
    ready = httpx.get(gateway.url + "/ready")
    counts = ready.json()["pools"][cluster.pool.name]
    assert (counts["context"]["routable"], counts["generation"]["routable"]) == (1, 1)
    assert ready.status_code == 200, ready.text
    statuses = []
    for _ in range(5):
        response = post(gateway, cluster)
        statuses.append(response.status_code)
        if response.status_code == 200:
            row = audit_row(response.headers["request-id"])
            assert (row.context_endpoint, row.generation_endpoint) == (cluster.context.url, cluster.generation.url)
        else:
            assert "is available" not in response.text, response.text
    assert statuses == [200] * 5
    metrics = httpx.get(gateway.url + "/metrics").text
    assert metric_value(metrics, "gateway_routed_despite_probes_total", pool=cluster.pool.name, role="generation") == 5.0
    assert metric_value(metrics, "gateway_routed_despite_probes_total", pool=cluster.pool.name, role="context") == 5.0
    # Logged once per change, not per request.
    log = gateway.log(None)
    assert len(re.findall(r"routing to its generation endpoints despite their probes", log)) == 1, log[-3000:]

    # /health answers in time again: the endpoint is healthy, the log says the fallback ended.
    cluster.generation.health_delay(0)
    cluster.context.health_delay(0)
    wait_until(lambda: endpoint(cluster, "generation").healthy and endpoint(cluster, "context").healthy, timeout=10)
    wait_until(lambda: "generation endpoints pass their probes again" in gateway.log(None), timeout=5)
    assert post(gateway, cluster).status_code == 200


def test_a_role_with_nothing_left_explains_each_endpoint_in_the_log_once_never_to_the_client(
    probing_gateway: Gateway, cluster: Cluster
) -> None:
    gateway = probing_gateway
    wait_registered(gateway, cluster)
    # The only context endpoint goes, and one that refuses connections takes its place: a probe
    # that is refused is a verdict (nothing listens there), not a slow answer.
    live = endpoint(cluster, "context")
    dead = WorkerEndpoint.objects.create(pool=cluster.pool, role="context", url=refused_url())
    WorkerEndpoint.objects.filter(pk=live.pk).update(draining=True)
    wait_until(lambda: not WorkerEndpoint.objects.get(pk=dead.pk).healthy, timeout=10, message="the dead endpoint never marked unhealthy")
    wait_until(lambda: post(gateway, cluster).status_code == 529, timeout=5)
    for _ in range(5):
        response = post(gateway, cluster)
        assert response.status_code == 529 and response.json()["error"]["type"] == "overloaded_error"
        assert dead.url not in response.text and live.url not in response.text
        assert "127.0.0.1" not in response.text
    log = gateway.log(None)
    explained = [line for line in log.splitlines() if "no context endpoint of pool" in line]
    assert len(explained) == 1, log[-3000:]
    line = explained[0]
    assert f"#{live.pk} ({live.url}): draining" in line
    assert re.search(rf"#{dead.pk} \({re.escape(dead.url)}\): unhealthy since \S+ \(\d+ failed probes?, last: [^)]+\)", line), line


def test_a_gateway_that_stalls_does_not_blame_the_worker_for_its_own_lag(cluster: Cluster) -> None:
    """The gateway process stops (SIGSTOP) for longer than a probe's timeout while a probe is out,
    the worker's answer arriving meanwhile. A probe timed by the wall clock fails then: on resume
    the loop runs the due timeout before it reads the socket. One failure is enough to mark the
    endpoint unhealthy here, so any stall so counted shows."""
    with Gateway({**FAST_PROBES, "HEALTH_UNHEALTHY_AFTER": "1"}) as gateway:
        wait_registered(gateway, cluster)
        # /health answers in half the probe's 1 s: most of the time a probe is out.
        cluster.generation.health_delay(0.5)
        assert gateway.process is not None
        pid = gateway.process.pid
        for _ in range(6):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(1.5)  # the stall itself, longer than the probe's timeout
            os.kill(pid, signal.SIGCONT)
            # Let a round of probes run in time between stalls.
            wait_until(lambda: post(gateway, cluster).status_code == 200, timeout=10)
        assert "is now unhealthy" not in gateway.log(None)
        assert endpoint(cluster, "generation").healthy


@pytest.fixture
def healthy_but_503_url() -> Iterator[str]:
    """A context endpoint that passes its probes and answers every chat request 503 with no body
    (a proxy in front of a worker that just went down): the gateway retries such a failure once
    on another context endpoint."""

    def respond(request: Request) -> bytes:
        if request.path == "/health":
            return json_response(200, {"status": "ok"})
        return scripted_response(503, headers={"connection": "close"})

    with ScriptedServer(answering(respond)) as server:
        yield server.url


def test_the_context_retry_goes_to_an_endpoint_only_slow_to_answer_its_probes(
    probing_gateway: Gateway, cluster: Cluster, healthy_but_503_url: str
) -> None:
    gateway = probing_gateway
    failing = WorkerEndpoint.objects.create(pool=cluster.pool, role="context", url=healthy_but_503_url)
    wait_registered(gateway, cluster)
    cluster.context.health_delay(LATE_S)
    wait_until(lambda: not endpoint(cluster, "context", cluster.context.url).healthy, timeout=10)
    for _ in range(3):
        response = post(gateway, cluster)
        assert response.status_code == 200, response.text
        rows = reservations_closed(response.headers["request-id"])
        assert sorted((r.endpoint_url, r.outcome) for r in rows if r.stage == "context") == sorted(
            [(failing.url, "failure"), (cluster.context.url, "success")]
        )


def test_a_process_started_after_another_marked_the_worker_down_trusts_its_own_first_probe(cluster: Cluster) -> None:
    # Another gateway process (or a former one) wrote "unhealthy"; the workers are up. Twenty
    # good probes would take 20 s: the first one here is enough.
    WorkerEndpoint.objects.filter(pool=cluster.pool).update(healthy=False)
    probes = {"HEALTH_CHECK_INTERVAL_S": "1", "HEALTH_CHECK_TIMEOUT_S": "1", "HEALTH_UNHEALTHY_AFTER": "2", "HEALTH_HEALTHY_AFTER": "20"}
    with Gateway(probes) as gateway:
        wait_registered(gateway, cluster)
        wait_until(lambda: post(gateway, cluster).status_code == 200, timeout=8, message="refused after this process's probes found the workers up")
        assert endpoint(cluster, "generation").healthy and endpoint(cluster, "context").healthy
