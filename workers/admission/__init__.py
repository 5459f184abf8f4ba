"""Admission: a request takes a slot on an endpoint with room, or waits in the gateway's queue for
the first one that frees.

    capacity.py   endpoint slots, counted in Redis across processes (or in this process)
    queue.py      the fair admission queue: strict priority, then fair share in tokens
    headroom.py   the last free slots of a busy pool kept for keys under their share

`admit` is what the router calls. A pool none of whose usable endpoints has a capacity takes the
fast path: no queue, no lease, no await.

An endpoint whose engine reports a long queue or a nearly full KV cache (fresh figures at
`ENGINE_LOAD_ADMIT_MAX_WAITING` / `ENGINE_LOAD_ADMIT_MAX_KV_USAGE`: `EngineLoads.holds`) counts as
full too, capped or not, whoever filled it: the request waits here, where its key's priority
and fair share order it, rather than in the engine's FIFO. The engine-load poll wakes the
waiters when its figures clear or go stale (`workers.cluster.services`). With both settings off
(the default) `engine_loads.holding` stays empty, and that one attribute is all admission reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable

from django.conf import settings

from disagg_project import new_id
from workers.admission import capacity
from workers.admission.headroom import activity, free_slots, slots_to_keep
from workers.admission.queue import AdmissionQueue, AdmissionRefused, Priority, Ticket, get_queue
from workers.cluster.engine_load import engine_loads
from workers.cluster.registry import EndpointInfo

__all__ = ["activity", "AdmissionRefused", "admit", "Priority", "Ticket"]

Counts = Callable[[int], tuple[int, int]]


async def admit(
    resource: Hashable,
    ticket: Ticket,
    usable: Callable[[bool], list[EndpointInfo]],
    pick: Callable[[list[EndpointInfo]], EndpointInfo],
    *,
    tokens: int,
    held_here: Counts,
) -> tuple[EndpointInfo, str | None]:
    """The endpoint `pick` chooses among the usable ones with room, and the slot's lease (None
    for an endpoint without a capacity). Waits in the queue while none has room; raises
    `AdmissionRefused` when the wait expires or the queue is full, and whatever `usable` raises
    (no usable endpoint at all).

    `usable(fresh)` gives the endpoints to choose from, `fresh` after a wait (capacities, health
    and the other processes' load change while a request waits);
    `held_here(endpoint_id)` is what this process holds there: (requests, tokens)."""
    endpoints = usable(False)
    if not any(e.capped for e in endpoints) and not (engine_loads.holding and any(engine_loads.holds(e.id) for e in endpoints)):
        return pick(endpoints), None
    queue = get_queue()
    activity.asked(resource, ticket, time.monotonic())
    waiter = None
    outcome = "failed"

    async def attempt(endpoints: list[EndpointInfo]) -> tuple[EndpointInfo, str | None] | None:
        if _must_leave_headroom(queue, resource, ticket, endpoints, held_here):
            queue.hold_back(resource, ticket.flow, True)
            return None
        queue.hold_back(resource, ticket.flow, False)
        return await _try(endpoints, pick, tokens, held_here)

    try:
        if not queue.busy(resource):
            taken = await attempt(endpoints)
            if taken is not None:
                outcome = "admitted"
                return taken
        deadline = asyncio.get_running_loop().time() + settings.ADMISSION_QUEUE_TIMEOUT_S
        waiter = await queue.wait_turn(resource, ticket, deadline)
        while True:
            taken = await attempt(usable(True))
            if taken is not None:
                outcome = "admitted"
                return taken
            await queue.wait_again(waiter, deadline)
    finally:
        if outcome == "admitted":
            queue.charge(ticket, ticket.tokens)
        if waiter is not None:
            queue.leave(waiter, outcome)


def _must_leave_headroom(
    queue: AdmissionQueue, resource: Hashable, ticket: Ticket, endpoints: list[EndpointInfo], held_here: Counts
) -> bool:
    """Whether the request is held back to keep the pool's headroom free (`headroom`): only on
    a pool whose every usable endpoint has a request capacity."""
    if not all(e.capacity is not None for e in endpoints):
        return False
    total = sum(e.capacity for e in endpoints)  # type: ignore[misc]
    keep = slots_to_keep(resource, ticket, total, time.monotonic(), queue.waiting_flows(resource))
    return keep > 0 and free_slots(endpoints, [held_here(e.id)[0] for e in endpoints]) - 1 < keep


async def _try(
    endpoints: list[EndpointInfo], pick: Callable[[list[EndpointInfo]], EndpointInfo], tokens: int, held_here: Counts
) -> tuple[EndpointInfo, str | None] | None:
    holding = engine_loads.holding  # empty unless an engine's figures hold admission somewhere
    roomy = [
        e for e in endpoints
        if not (holding and engine_loads.holds(e.id)) and (not e.capped or capacity.fits_here(e, *held_here(e.id), tokens))
    ]  # fmt: skip
    while roomy:
        endpoint = pick(roomy)
        if not endpoint.capped:
            return endpoint, None
        lease = new_id()
        if await capacity.acquire(endpoint, lease, tokens, *held_here(endpoint.id)):
            return endpoint, lease
        roomy.remove(endpoint)  # full in another process's count: the next choice
    return None
