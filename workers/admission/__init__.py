"""Admission: a request takes a slot on an endpoint with room, or waits in the gateway's queue for
the first one that frees.

    capacity.py   endpoint slots, counted in Redis across processes (or in this process)
    queue.py      the fair admission queue: strict priority, then fair share in tokens

`admit` is what the router calls. A pool none of whose usable endpoints has a capacity takes the
fast path: no queue, no lease, no await.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable

from django.conf import settings

from workers.admission import capacity
from workers.admission.queue import AdmissionRefused, Priority, Ticket, get_queue
from workers.cluster.instance import new_id
from workers.cluster.registry import EndpointInfo

__all__ = ["AdmissionRefused", "Priority", "Ticket", "admit"]

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
    if not any(e.capped for e in endpoints):
        return pick(endpoints), None
    queue = get_queue()
    waiter = None
    outcome = "failed"
    try:
        if not queue.busy(resource):
            taken = await _try(endpoints, pick, tokens, held_here)
            if taken is not None:
                outcome = "admitted"
                return taken
        deadline = asyncio.get_running_loop().time() + settings.ADMISSION_QUEUE_TIMEOUT_S
        waiter = await queue.wait_turn(resource, ticket, deadline)
        while True:
            taken = await _try(usable(True), pick, tokens, held_here)
            if taken is not None:
                outcome = "admitted"
                return taken
            await queue.wait_again(waiter, deadline)
    finally:
        if outcome == "admitted":
            queue.charge(ticket, ticket.tokens)
        if waiter is not None:
            queue.leave(waiter, outcome)


async def _try(
    endpoints: list[EndpointInfo], pick: Callable[[list[EndpointInfo]], EndpointInfo], tokens: int, held_here: Counts
) -> tuple[EndpointInfo, str | None] | None:
    roomy = [e for e in endpoints if not e.capped or capacity.fits_here(e, *held_here(e.id), tokens)]
    while roomy:
        endpoint = pick(roomy)
        if not endpoint.capped:
            return endpoint, None
        lease = new_id()
        if await capacity.acquire(endpoint, lease, tokens, *held_here(endpoint.id)):
            return endpoint, lease
        roomy.remove(endpoint)  # full in another process's count: the next choice
    return None
