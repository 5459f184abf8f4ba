"""Engine-reported load: collection (`workers.cluster.engine_load`), its staleness, the one
poller per endpoint that Redis elects, and the blend routing makes of it (`router._load`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from django.test import override_settings

from disagg_project import get_shared_state
from tests.support.redis import redis_url_or_skip
from workers.cluster import engine_load as module
from workers.cluster.engine_load import EngineLoads, _entry, holds_admission, kv_penalty
from workers.cluster.registry import ClusterSnapshot, EndpointInfo, PoolInfo
from workers.exceptions import WorkerUnreachable
from workers.protocols.engine_load import EngineLoad
from workers.routing import router

_ids = itertools.count(80_000)

VLLM_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5
"""


def make_pool(n: int = 2, protocol: str = "vllm") -> PoolInfo:
    name = f"eload-{next(_ids)}"
    endpoints = tuple(
        EndpointInfo(id=next(_ids), pool_name=name, role="generation", url=f"http://{name}-{i}:8000", enabled=True, draining=False,
                     healthy=True)
        for i in range(n)
    )  # fmt: skip
    return PoolInfo(
        id=next(_ids), name=name, model="m", schedule_style="aggregated", max_local_prefill_tokens=0, routing="least_loaded",
        protocol=protocol, created_at=datetime.now(timezone.utc), endpoints=endpoints,
    )  # fmt: skip


class FakeRegistry:
    def __init__(self, *pools: PoolInfo) -> None:
        self.snap = ClusterSnapshot(pools=pools, loaded_at=time.monotonic())

    async def snapshot(self) -> ClusterSnapshot:
        return self.snap


class Engines:
    """What each endpoint's /metrics answers (an exception: the read fails), and the reads made."""

    def __init__(self) -> None:
        self.answers: dict[str, str | Exception] = {}
        self.reads: list[str] = []

    async def get_text(self, url: str, *, timeout: float, limit: int, stage: str) -> str:
        self.reads.append(url)
        answer = self.answers[url]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Engines:
    fake = Engines()
    monkeypatch.setattr(module.client, "get_text", fake.get_text)
    return fake


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineLoads]:
    """A fresh view, standing in for the process's one (routing reads that)."""
    fresh = EngineLoads()
    monkeypatch.setattr(module, "engine_loads", fresh)
    monkeypatch.setattr(router, "engine_loads", fresh)
    yield fresh


# --- the blend -------------------------------------------------------------------------------------


def test_the_larger_count_wins_and_a_full_cache_adds_a_penalty(loads: EngineLoads, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = make_pool(1).endpoints[0]
    own = {"n": 0}
    monkeypatch.setattr(router.ledger, "open_count", lambda endpoint_id: own["n"])

    def load(mine: int, reported: EngineLoad) -> int:
        own["n"] = mine
        loads.view[endpoint.id] = _entry(reported, time.time(), polled_here=True)
        return router._load(endpoint)

    with override_settings(ENGINE_LOAD_KV_THRESHOLD=0.9, ENGINE_LOAD_KV_PENALTY=8):
        assert load(2, EngineLoad(waiting=40, running=2)) == 42
        assert load(5, EngineLoad(waiting=0, running=3)) == 5  # the gateway's own requests, not yet there
        assert load(0, EngineLoad(waiting=0, running=0, kv_usage=0.9)) == 0
        assert load(0, EngineLoad(waiting=0, running=0, kv_usage=0.95)) == 4
        assert load(1, EngineLoad(waiting=0, running=1, kv_usage=1.0)) == 9
    assert kv_penalty(None) == 0


def test_routing_avoids_an_engine_busy_with_outside_traffic_while_its_figures_are_fresh(loads: EngineLoads) -> None:
    pool = make_pool(3)
    busy, *idle = pool.endpoints
    loads.view[busy.id] = _entry(EngineLoad(waiting=30, running=8), time.time(), polled_here=True)
    picked = [router._least_loaded(pool, "generation", list(pool.endpoints), None) for _ in range(20)]
    assert busy not in picked and {e.id for e in picked} == {e.id for e in idle}
    assert router._load(busy) == 38


def test_stale_figures_fall_back_to_the_gateways_own_counts(loads: EngineLoads) -> None:
    pool = make_pool(2)
    busy, other = pool.endpoints
    with override_settings(ENGINE_LOAD_MAX_AGE_S=5.0):
        loads.view[busy.id] = _entry(EngineLoad(waiting=30, running=8), time.time() - 6.0, polled_here=True)
        assert loads.fresh(busy.id) is None
        assert router._load(busy) == 0
        picked = {router._least_loaded(pool, "generation", list(pool.endpoints), None).id for _ in range(4)}
        assert picked == {busy.id, other.id}  # an idle pool's round robin again


def test_without_figures_the_load_is_the_gateways_own(loads: EngineLoads) -> None:
    endpoint = make_pool(1).endpoints[0]
    assert not loads.view
    assert router._load(endpoint) == 0


# --- collection ------------------------------------------------------------------------------------


async def test_each_engine_is_read_and_a_failing_one_is_logged_once(
    loads: EngineLoads, engines: Engines, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool, plain = make_pool(2), make_pool(1, protocol="openai")
    good, bad = pool.endpoints
    monkeypatch.setattr(module, "get_registry", lambda: FakeRegistry(pool, plain))
    engines.answers[good.url + "/metrics"] = VLLM_TEXT.format(running=2, waiting=9)
    engines.answers[bad.url + "/metrics"] = WorkerUnreachable(502, "connection refused", stage="metrics")
    with override_settings(REDIS_URL=""), caplog.at_level(logging.WARNING, logger=module.__name__):
        await loads.poll_all()
        await loads.poll_all()
    assert (loads.fresh(good.id) or pytest.fail("not fresh")).load == EngineLoad(waiting=9, running=2, kv_usage=0.5)
    assert loads.fresh(bad.id) is None and "connection refused" in loads.error(bad.id)
    assert sorted(set(engines.reads)) == sorted([good.url + "/metrics", bad.url + "/metrics"])  # a plain OpenAI server: never
    assert loads.polls[good.id]["ok"] == 2 and loads.polls[bad.id]["failed"] == 2
    assert len([r for r in caplog.records if bad.url in r.getMessage()]) == 1

    engines.answers[bad.url + "/metrics"] = "<html>no metrics here</html>"
    with override_settings(REDIS_URL=""):
        await loads.poll_all()
    assert loads.polls[bad.id]["unreadable"] == 1 and "no vllm load figures" in loads.error(bad.id)


async def test_an_endpoint_that_leaves_the_pool_is_forgotten(loads: EngineLoads, engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(1)
    (endpoint,) = pool.endpoints
    engines.answers[endpoint.url + "/metrics"] = VLLM_TEXT.format(running=0, waiting=0)
    monkeypatch.setattr(module, "get_registry", lambda: FakeRegistry(pool))
    with override_settings(REDIS_URL=""):
        await loads.poll_all()
        assert endpoint.id in loads.view
        monkeypatch.setattr(module, "get_registry", lambda: FakeRegistry())
        await loads.poll_all()
    assert endpoint.id not in loads.view and endpoint.id not in loads.polls


async def test_with_redis_one_process_reads_each_engine_and_the_other_takes_its_figures(
    engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = redis_url_or_skip()
    pool = make_pool(2)
    first, second = pool.endpoints
    for endpoint in pool.endpoints:
        engines.answers[endpoint.url + "/metrics"] = VLLM_TEXT.format(running=1, waiting=20)
    monkeypatch.setattr(module, "get_registry", lambda: FakeRegistry(pool))
    a, b = EngineLoads(), EngineLoads()
    with override_settings(REDIS_URL=url, REDIS_KEY_PREFIX=f"test-eload-{secrets.token_hex(4)}:", ENGINE_LOAD_POLL_S=0.2):
        shared = get_shared_state()
        try:
            monkeypatch.setattr(module, "GATEWAY_INSTANCE", "process-a")
            await a.poll_all()
            await shared.drain()  # its figures published
            monkeypatch.setattr(module, "GATEWAY_INSTANCE", "process-b")
            await b.poll_all()
            monkeypatch.setattr(module, "GATEWAY_INSTANCE", "process-a")
            await a.poll_all()  # the holder keeps its leases
            await shared.drain()
        finally:
            await shared.aclose()
    assert len(engines.reads) == 4  # two endpoints, read twice, by process a alone
    assert sum(sum(c.values()) for c in b.polls.values()) == 0
    for endpoint in (first, second):
        figures = b.view[endpoint.id]
        assert figures.load == EngineLoad(waiting=20, running=1, kv_usage=0.5) and not figures.polled_here and figures.fresh
        assert a.view[endpoint.id].polled_here


async def test_when_redis_fails_each_process_reads_every_engine(loads: EngineLoads, engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(1)
    (endpoint,) = pool.endpoints
    engines.answers[endpoint.url + "/metrics"] = VLLM_TEXT.format(running=0, waiting=3)
    monkeypatch.setattr(module, "get_registry", lambda: FakeRegistry(pool))
    with override_settings(REDIS_URL="redis://127.0.0.1:9/0", REDIS_RETRY_S=60.0, REDIS_TIMEOUT_S=0.2):
        shared = get_shared_state()
        try:
            await loads.poll_all()
        finally:
            await shared.aclose()
    assert (loads.fresh(endpoint.id) or pytest.fail("not fresh")).load == EngineLoad(waiting=3, running=0, kv_usage=0.5)


async def test_figures_nobody_refreshes_go_stale(loads: EngineLoads, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    endpoint = make_pool(1).endpoints[0]
    with override_settings(ENGINE_LOAD_MAX_AGE_S=0.05):
        loads.view[endpoint.id] = _entry(EngineLoad(waiting=9, running=0), time.time(), polled_here=False)
        assert loads.fresh(endpoint.id) is not None
        loads._note_freshness()
        await asyncio.sleep(0.1)
        with caplog.at_level(logging.WARNING, logger=module.__name__):
            loads._note_freshness()
            loads._note_freshness()
    assert loads.fresh(endpoint.id) is None
    assert len([r for r in caplog.records if "gateway's own counts" in r.getMessage()]) == 1


def test_published_figures_that_are_not_ours_are_ignored(loads: EngineLoads) -> None:
    for junk in ("", "not json", '{"w": "x"}', "[]"):
        loads._take_published(1, junk)
    assert not loads.view




# --- admission -------------------------------------------------------------------------------------


def test_an_engine_holds_admission_at_its_queue_or_kv_setting_and_never_when_they_are_off() -> None:
    assert not holds_admission(EngineLoad(waiting=1000, running=9, kv_usage=1.0), 0, 0.0)  # the default: off
    assert not holds_admission(EngineLoad(waiting=7, running=9), 8, 0.0)
    assert holds_admission(EngineLoad(waiting=8, running=0), 8, 0.0)
    assert not holds_admission(EngineLoad(waiting=0, running=9, kv_usage=0.94), 0, 0.95)
    assert holds_admission(EngineLoad(waiting=0, running=9, kv_usage=0.95), 0, 0.95)
    assert not holds_admission(EngineLoad(waiting=0, running=9, kv_usage=None), 8, 0.95)  # an engine that does not say


async def test_the_poll_marks_the_endpoints_that_hold_admission_and_returns_where_they_stop(
    loads: EngineLoads, engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = make_pool(2)
    busy, idle = pool.endpoints
    monkeypatch.setattr(module, "get_registry", lambda: FakeRegistry(pool))
    engines.answers[idle.url + "/metrics"] = VLLM_TEXT.format(running=1, waiting=0)
    engines.answers[busy.url + "/metrics"] = VLLM_TEXT.format(running=4, waiting=12)
    with override_settings(REDIS_URL=""):
        assert await loads.poll_all() == set()
        assert not loads.holding  # the setting is off: nothing holds
        with override_settings(ENGINE_LOAD_ADMIT_MAX_WAITING=8):
            assert await loads.poll_all() == set()
            assert loads.holding == {busy.id} and loads.holds(busy.id) and not loads.holds(idle.id)
            assert await loads.poll_all() == set()  # still holding: nothing to wake
            engines.answers[busy.url + "/metrics"] = VLLM_TEXT.format(running=4, waiting=3)
            assert await loads.poll_all() == {(pool.name, "generation")}  # its queue cleared: wake the waiters
            assert not loads.holding


async def test_stale_figures_hold_nothing_and_their_waiters_are_woken(
    loads: EngineLoads, engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = make_pool(1)
    (busy,) = pool.endpoints
    monkeypatch.setattr(module, "get_registry", lambda: FakeRegistry(pool))
    engines.answers[busy.url + "/metrics"] = VLLM_TEXT.format(running=4, waiting=12)
    with override_settings(REDIS_URL="", ENGINE_LOAD_ADMIT_MAX_WAITING=8, ENGINE_LOAD_MAX_AGE_S=0.05):
        await loads.poll_all()
        assert loads.holds(busy.id)
        engines.answers[busy.url + "/metrics"] = WorkerUnreachable(502, "connection refused", stage="metrics")
        await asyncio.sleep(0.1)
        assert not loads.holds(busy.id)  # at once, before any poll: the gateway's own counts decide
        assert await loads.poll_all() == {(pool.name, "generation")}
