"""The router's spill-over across the pools serving one model (`choose_pool`): a pool whose every
endpoint's engine reports a queue at ENGINE_LOAD_ADMIT_MAX_WAITING has no room now, like a pool at
capacity, and the request goes to the next pool instead of waiting."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from django.test import override_settings

from workers.cluster.engine_load import EngineLoads, _entry
from workers.cluster.registry import EndpointInfo, PoolInfo, Served
from workers.protocols.engine_load import EngineLoad
from workers.routing import router

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
