"""Routing on what the engines report, end to end: real daphne gateways that read the sims'
Prometheus metrics, a sim that reports a long queue of outside traffic, Anthropic requests.

- new conversations avoid the engine whose queue is long while another is idle (least_loaded and
  cache_aware alike): the issue's target is at most 10 % to the busy one; also when the queue is
  under the cache-aware load guard's threshold;
- figures that stop coming go stale, routing falls back to the gateway's own counts, visibly;
- with Redis, two gateway processes read each engine once between them (counted at the sim), and
  both route on the figures;
- with ENGINE_LOAD_ADMIT_MAX_WAITING set, requests wait in the gateway's admission queue while
  the engines report a queue that long, and go as soon as the figures clear.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.cluster import MODEL, Cluster, audit_row, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.prometheus import metric_value
from tests.support.redis import redis_url_or_skip
from tests.support.simworkers import SimWorker, start_simworker

SIM = {"tokens_per_second": 0, "prefill_tokens_per_second": 0, "max_context_tokens": 4096, "protocol": "vllm",
       "kv_block_tokens": 16, "kv_cache_blocks": 4096}  # fmt: skip
POLL = {"ENGINE_LOAD_POLL_S": "0.1", "ENGINE_LOAD_MAX_AGE_S": "1.0"}
OUTSIDE_QUEUE = 50
SHORT_QUEUE = 3
CONVERSATIONS = 20


@pytest.fixture
def polling(transactional_db: Any) -> Iterator[Callable[..., Gateway]]:
    """`polling(**env)` → a gateway that reads the engines' load, stopped when the test ends: the
    suite's shared gateways read none, and one left running would read every later test's sims."""
    started: list[Gateway] = []

    def start(**env: str) -> Gateway:
        started.append(Gateway({**POLL, **env}).start())
        return started[-1]

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimWorker, SimWorker]]:
    busy, idle = start_simworker("generation", **SIM), start_simworker("generation", **SIM)
    yield busy, idle
    busy.stop()
    idle.stop()


def register(routing: str, *gateways: Gateway, sims: tuple[SimWorker, SimWorker]) -> Cluster:
    """An aggregated vLLM pool of the two sims (generation endpoints only)."""
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(name=f"pool-{MODEL}", model=MODEL, schedule_style="aggregated", protocol="vllm", routing=routing)
    for sim in sims:
        WorkerEndpoint.objects.create(pool=pool, role="generation", url=sim.url)
        sim.outside_load(0)
        sim.reset()
    _, key = create_api_key(f"test-key-{time.monotonic_ns()}")
    cluster = Cluster(pool=pool, key=key, model=MODEL, context=sims[0], generation=sims[1])
    for gateway in gateways:
        wait_registered(gateway, cluster)
    return cluster


def scrape(gateway: Gateway) -> str:
    return httpx.get(gateway.url + "/metrics", timeout=5).text


def figures(gateway: Gateway, sim: SimWorker, name: str) -> float | None:
    try:
        return metric_value(scrape(gateway), name, endpoint=sim.url)
    except AssertionError:
        return None


def wait_figures(gateway: Gateway, sim: SimWorker, *, waiting: int, fresh: bool = True) -> None:
    wait_until(
        lambda: figures(gateway, sim, "gateway_engine_load_fresh") == (1.0 if fresh else 0.0)
        and (not fresh or figures(gateway, sim, "gateway_engine_requests_waiting") == waiting),
        timeout=15, message=f"{gateway.url} never had {'fresh' if fresh else 'stale'} figures of {sim.url} (waiting {waiting})",
    )


def new_conversations(gateway: Gateway, cluster: Cluster, n: int, tag: str) -> None:
    for i in range(n):
        body = {
            "model": cluster.model, "max_tokens": 4, "system": f"[{tag} {i}] You are a coding agent. " * 20,
            "messages": [{"role": "user", "content": f"conversation {tag}-{i}: hello"}],
        }  # fmt: skip
        response = httpx.post(gateway.url + "/v1/messages", json=body, headers=cluster.headers(), timeout=30)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("queue", [OUTSIDE_QUEUE, SHORT_QUEUE], ids=["long_queue", "queue_under_the_load_guard"])
@pytest.mark.parametrize("routing", ["least_loaded", "cache_aware"])
def test_new_conversations_avoid_an_engine_with_a_queue_of_outside_traffic(
    polling: Callable[..., Gateway], sims: tuple[SimWorker, SimWorker], routing: str, queue: int
) -> None:
    """One engine also serves traffic the gateway did not send (its queue, as it reports it):
    at most a tenth of new conversations go there while the other is idle. A queue of 3 is under
    the cache-aware load guard (PREFIX_BALANCE_ABS_THRESHOLD, 4): the choice between a new
    conversation's two endpoints must itself look at the engines' queues (on the conversations
    each serves first, every other one went to the busy engine, which serves fewer)."""
    busy, idle = sims
    gateway = polling()
    cluster = register(routing, gateway, sims=sims)
    busy.outside_load(queue)
    wait_figures(gateway, busy, waiting=queue)
    wait_figures(gateway, idle, waiting=0)

    new_conversations(gateway, cluster, CONVERSATIONS, f"q{queue}-{routing}")

    to_busy, to_idle = busy.stats()["received"], idle.stats()["received"]
    assert to_busy + to_idle == CONVERSATIONS
    assert to_busy <= CONVERSATIONS // 10, (to_busy, to_idle)


def test_figures_that_stop_coming_go_stale_and_routing_falls_back_to_its_own_counts(
    polling: Callable[..., Gateway], sims: tuple[SimWorker, SimWorker]
) -> None:
    busy, idle = sims
    gateway = polling()
    cluster = register("least_loaded", gateway, sims=sims)
    busy.outside_load(OUTSIDE_QUEUE)
    wait_figures(gateway, busy, waiting=OUTSIDE_QUEUE)

    busy.outside_load(OUTSIDE_QUEUE, metrics_status=503)  # its metrics break; the last figures age
    wait_figures(gateway, busy, waiting=OUTSIDE_QUEUE, fresh=False)
    assert (figures(gateway, busy, "gateway_engine_load_age_seconds") or 0) >= 1.0
    assert metric_value(scrape(gateway), "gateway_engine_load_polls_total", endpoint=busy.url, outcome="failed") >= 1
    wait_until(lambda: "cannot read the engine load of endpoint " + busy.url in gateway.log(None), message="no log line")

    new_conversations(gateway, cluster, 10, "stale")
    # The gateway's own counts alone: an idle pool's round robin, half each.
    assert busy.stats()["received"] == 5 and idle.stats()["received"] == 5


def test_two_gateway_processes_with_redis_read_each_engine_once_between_them(
    polling: Callable[..., Gateway], sims: tuple[SimWorker, SimWorker]
) -> None:
    url = redis_url_or_skip()
    busy, idle = sims
    first, second = polling(REDIS_URL=url), polling(REDIS_URL=url)
    cluster = register("least_loaded", first, second, sims=sims)
    busy.outside_load(OUTSIDE_QUEUE)
    for gateway in (first, second):
        wait_figures(gateway, busy, waiting=OUTSIDE_QUEUE)
        wait_figures(gateway, idle, waiting=0)

    def polls() -> dict[tuple[str, str], float]:
        counts = {}
        for name, gateway in (("a", first), ("b", second)):
            text = scrape(gateway)
            for sim in sims:
                try:
                    counts[(name, sim.url)] = metric_value(text, "gateway_engine_load_polls_total", endpoint=sim.url, outcome="ok")
                except AssertionError:
                    counts[(name, sim.url)] = 0.0
        return counts

    before = polls()
    for sim in sims:
        sim.reset()
    wait_until(lambda: min(sim.stats()["metrics_reads"] for sim in sims) >= 20, timeout=30, message="the sims were not polled")
    reads = {sim.url: sim.stats()["metrics_reads"] for sim in sims}
    after = polls()
    for sim in sims:
        made = sorted(after[(name, sim.url)] - before[(name, sim.url)] for name in ("a", "b"))
        # One process reads it (a lease lapsing under a stalled loop may hand it over once).
        assert made[0] <= 0.2 * made[1], (sim.url, made)
        # ...and the sim saw about one poller's reads, not two (a poll every 0.1 s at most).
        assert reads[sim.url] <= made[0] + made[1] + 3, (sim.url, reads, made)

    new_conversations(first, cluster, 5, "first")
    new_conversations(second, cluster, 5, "second")
    assert busy.stats()["received"] <= 1, busy.stats()


def test_requests_wait_in_the_gateways_queue_while_the_engines_report_a_long_queue_and_go_when_it_clears(
    polling: Callable[..., Gateway], sims: tuple[SimWorker, SimWorker]
) -> None:
    # The queue's own look every ADMISSION_POLL_INTERVAL_S (for slots freed elsewhere) put out of
    # the way: only the engine-load poll that sees the queue clear can wake the waiters in time.
    gateway = polling(ENGINE_LOAD_ADMIT_MAX_WAITING="8", ADMISSION_POLL_INTERVAL_S="60")
    cluster = register("least_loaded", gateway, sims=sims)  # uncapped: only the engines' figures hold
    for sim in sims:
        sim.outside_load(OUTSIDE_QUEUE)
    for sim in sims:
        wait_figures(gateway, sim, waiting=OUTSIDE_QUEUE)
        wait_until(lambda sim=sim: figures(gateway, sim, "gateway_engine_load_holds_admission") == 1.0, message="not holding")

    def depth() -> float:
        try:
            return metric_value(scrape(gateway), "gateway_admission_queue_depth", priority="standard")
        except AssertionError:
            return 0.0  # no request has queued yet: no sample

    def polls_made() -> float:
        return sum(metric_value(scrape(gateway), "gateway_engine_load_polls_total", endpoint=sim.url, outcome="ok") for sim in sims)

    with ThreadPoolExecutor(3) as clients:
        body = {"model": cluster.model, "max_tokens": 4, "messages": [{"role": "user", "content": "held while the engines queue"}]}
        sent = [clients.submit(httpx.post, gateway.url + "/v1/messages", json=body, headers=cluster.headers(), timeout=30) for _ in range(3)]
        wait_until(lambda: depth() == 3, message="the requests never queued in the gateway")
        held_since = time.monotonic()
        before = polls_made()
        wait_until(lambda: polls_made() >= before + 6, message="the engines were not read again")  # several polls, still held
        assert depth() == 3 and sum(sim.stats()["received"] for sim in sims) == 0
        held_for = time.monotonic() - held_since

        for sim in sims:
            sim.outside_load(0)
        cleared = time.monotonic()
        answers = [future.result(timeout=15) for future in sent]
        went_after = time.monotonic() - cleared
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert went_after < 2.0  # at the next engine-load poll (0.1 s): nothing else would wake them
    assert sum(sim.stats()["received"] for sim in sims) == 3
    for answer in answers:
        row = audit_row(answer.headers["request-id"])
        assert row.status == "completed" and (row.queued_ms or 0) >= held_for * 1000, (row.queued_ms, held_for)
