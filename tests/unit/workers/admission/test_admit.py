"""Admission on the engines' own figures, driven through `workers.admission.admit` in-process: an
endpoint whose engine reports a long queue counts as full (capped or not), so a request goes to
another one, or waits in the gateway's queue (in its priority's order) until the figures clear;
stale figures hold nothing; with the settings off admission takes its fast path."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
from django.test import override_settings

import workers.admission as admission
from workers.admission import Priority, Ticket, admit
from workers.admission.queue import get_queue, notify_freed
from workers.cluster.engine_load import EngineLoads, _entry
from workers.cluster.registry import EndpointInfo
from workers.protocols.engine_load import EngineLoad

_ids = itertools.count(90_000)
_names = itertools.count()
MAX_WAITING = 8
LONG_QUEUE = EngineLoad(waiting=30, running=4)
CLEARED = EngineLoad(waiting=0, running=4)


class Pool:
    """Uncapped endpoints of one resource, their engines' figures in `loads`, and the order in
    which requests were admitted."""

    def __init__(self, loads: EngineLoads, endpoints: int = 2) -> None:
        name = f"engine-held-{next(_names)}"
        self.resource = (name, "generation")
        self.loads = loads
        self.endpoints = [
            EndpointInfo(id=next(_ids), pool_name=name, role="generation", url=f"http://{name}-{i}", enabled=True,
                         draining=False, healthy=True)
            for i in range(endpoints)
        ]  # fmt: skip
        self.admitted: list[str] = []

    def report(self, endpoint: EndpointInfo, load: EngineLoad, *, age_s: float = 0.0) -> None:
        """The engine's figures as a poll leaves them (what `EngineLoads.poll_all` stores)."""
        self.loads.view[endpoint.id] = _entry(load, time.time() - age_s, polled_here=True)
        self.loads._note_holding({e.id: (e, None) for e in self.endpoints})  # type: ignore[misc]

    async def request(self, name: str, priority: Priority = Priority.STANDARD) -> EndpointInfo:
        def pick(usable: list[EndpointInfo]) -> EndpointInfo:
            self.admitted.append(name)
            return usable[0]

        endpoint, lease = await admit(
            self.resource, Ticket(flow=name, priority=priority), lambda fresh: self.endpoints, pick, tokens=10,
            held_here=lambda endpoint_id: (0, 0),
        )  # fmt: skip
        assert lease is None  # uncapped: no slot to hold
        return endpoint


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineLoads]:
    fresh = EngineLoads()
    monkeypatch.setattr(admission, "engine_loads", fresh)
    with override_settings(ENGINE_LOAD_ADMIT_MAX_WAITING=MAX_WAITING, ENGINE_LOAD_MAX_AGE_S=5.0, ADMISSION_POLL_INTERVAL_S=60):
        yield fresh


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_request_avoids_an_endpoint_whose_engine_reports_a_long_queue(loads: EngineLoads) -> None:
    pool = Pool(loads)
    busy, idle = pool.endpoints
    pool.report(busy, LONG_QUEUE)
    pool.report(idle, CLEARED)
    assert [await pool.request(f"r{i}") for i in range(3)] == [idle, idle, idle]
    assert get_queue().depth() == 0  # none waited


async def test_requests_wait_in_the_gateways_queue_while_every_engine_reports_one_and_go_in_priority_order_when_it_clears(
    loads: EngineLoads,
) -> None:
    pool = Pool(loads, endpoints=1)
    (engine,) = pool.endpoints
    pool.report(engine, LONG_QUEUE)
    batch = asyncio.create_task(pool.request("batch", Priority.BATCH))
    await settle()
    interactive = asyncio.create_task(pool.request("interactive", Priority.INTERACTIVE))
    await settle()
    assert not batch.done() and not interactive.done() and get_queue().depth() == 2

    pool.report(engine, CLEARED)  # the next poll; what it returns is woken (workers.cluster.services)
    notify_freed(pool.resource)
    assert await asyncio.wait_for(asyncio.gather(batch, interactive), 2) == [engine, engine]
    # The later interactive request went first: the engine's FIFO would have taken the batch one.
    assert pool.admitted == ["interactive", "batch"]


async def test_stale_figures_hold_nothing(loads: EngineLoads) -> None:
    pool = Pool(loads, endpoints=1)
    (engine,) = pool.endpoints
    pool.report(engine, LONG_QUEUE, age_s=10.0)  # older than ENGINE_LOAD_MAX_AGE_S
    assert await asyncio.wait_for(pool.request("r"), 2) == engine


async def test_with_the_settings_off_nothing_holds_and_admission_takes_its_fast_path(loads: EngineLoads) -> None:
    pool = Pool(loads, endpoints=1)
    (engine,) = pool.endpoints
    with override_settings(ENGINE_LOAD_ADMIT_MAX_WAITING=0, ENGINE_LOAD_ADMIT_MAX_KV_USAGE=0.0):
        pool.report(engine, EngineLoad(waiting=1000, running=64, kv_usage=1.0))
        assert not loads.holding
        assert await asyncio.wait_for(pool.request("r"), 2) == engine
