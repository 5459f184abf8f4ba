"""The router's spill-over across the pools serving one model (`choose_pool`): a pool whose every
endpoint's engine reports a queue at ENGINE_LOAD_ADMIT_MAX_WAITING has no room now, like a pool at
capacity, and the request goes to the next pool instead of waiting; a pool none of whose endpoints
passes its probes comes after one that does (pure: engine figures and health state set by hand)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from django.test import override_settings

from workers.cluster import health as health_module
from workers.cluster.engine_load import EngineLoads, _entry
from workers.cluster.health import ProbeState, health
from workers.cluster.registry import EndpointInfo, PoolInfo, Served
from workers.protocols.engine_load import EngineLoad
from workers.routing import router
from workers.routing.router import choose_pool

_ids = itertools.count(95_000)


def make_pool() -> PoolInfo:
    name = f"spill-{next(_ids)}"
    endpoint = EndpointInfo(id=next(_ids), pool_name=name, role="generation", url=f"http://{name}", enabled=True, draining=False,
                            healthy=True)  # fmt: skip
    return PoolInfo(
        id=next(_ids), name=name, model="m", schedule_style="aggregated", max_local_prefill_tokens=0, routing="round_robin",
        protocol="vllm", created_at=datetime.now(timezone.utc), endpoints=(endpoint,),
    )  # fmt: skip


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineLoads]:
    fresh = EngineLoads()
    monkeypatch.setattr(router, "engine_loads", fresh)
    with override_settings(ENGINE_LOAD_ADMIT_MAX_WAITING=8, ENGINE_LOAD_MAX_AGE_S=5.0):
        yield fresh


def report(loads: EngineLoads, pool: PoolInfo, waiting: int) -> None:
    (endpoint,) = pool.endpoints
    loads.view[endpoint.id] = _entry(EngineLoad(waiting=waiting, running=4), time.time(), polled_here=True)
    loads._note_holding({endpoint.id: (endpoint, pool)})


async def test_a_pool_whose_engines_report_a_long_queue_spills_over_to_the_next(loads: EngineLoads) -> None:
    first, second = make_pool(), make_pool()
    served = [Served(first, "m"), Served(second, "m")]
    assert router.choose_pool(served).pool is first  # idle: the preferred pool
    report(loads, first, 30)
    assert router.choose_pool(served).pool is second
    report(loads, second, 30)
    assert router.choose_pool(served).pool is first  # no room anywhere: the first usable one, to wait in
    report(loads, first, 0)
    assert router.choose_pool(served).pool is first


# --- pools that do not pass their probes ------------------------------------------------------------


def pool(pool_id: int, *, enabled: bool = True) -> PoolInfo:
    endpoint = EndpointInfo(
        id=9300 + pool_id, pool_name=f"p{pool_id}", role="generation", url=f"http://g{pool_id}", enabled=enabled, draining=False,
        healthy=True,
    )
    return PoolInfo(
        id=pool_id, name=f"p{pool_id}", model="m", schedule_style="aggregated", max_local_prefill_tokens=0, routing="round_robin",
        protocol="trtllm", created_at=datetime(2026, 12, 6, tzinfo=timezone.utc), endpoints=(endpoint,),
    )


def slow(the_pool: PoolInfo) -> None:
    state = health.probes[the_pool.endpoints[0].id] = ProbeState(last_checked_at=1.0)
    for _ in range(3):
        health_module._failed(state, "no answer within 2 s", timed_out=True)


@pytest.fixture
def forget_health(settings: object) -> Iterator[None]:
    settings.HEALTH_UNHEALTHY_AFTER = 3  # type: ignore[attr-defined]
    yield
    for pool_id in range(1, 4):
        health.probes.pop(9300 + pool_id, None)


async def test_with_no_pool_passing_its_probes_the_first_only_slow_one_is_chosen(forget_health: None) -> None:
    disabled, slow_one, other_slow = pool(1, enabled=False), pool(2), pool(3)
    slow(slow_one)
    slow(other_slow)
    served = [Served(p, "m") for p in (disabled, slow_one, other_slow)]
    assert choose_pool(served).pool is slow_one


async def test_a_pool_passing_its_probes_comes_before_a_slow_one(forget_health: None) -> None:
    slow_one, healthy = pool(1), pool(2)
    slow(slow_one)
    assert choose_pool([Served(slow_one, "m"), Served(healthy, "m")]).pool is healthy


async def test_with_nothing_routable_the_first_pool_answers(forget_health: None) -> None:
    first, second = pool(1, enabled=False), pool(2, enabled=False)
    assert choose_pool([Served(first, "m"), Served(second, "m")]).pool is first
