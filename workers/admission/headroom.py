"""Headroom: the last free slots of a pool are kept for the keys that need them most.

The admission queue alone is work-conserving: a freed slot goes to whoever waits, and a key
flooding the pool always waits, so it ends up holding every slot the others are not using at
that instant. A well-behaved key's next request then waits for a release — its time to first
token tracks the flood's request length, not its own. (bench/tenants.py measured 20–52 × the
solo p99 for keys at their fair share while one key flooded at 10 × the pool.)

The rule, SGLang's model gateway's "reserved capacity" made per key: while several keys are
active on a pool's role, a request must leave free the part of their fair shares (capacity ÷
the active keys of its class or a higher one) that those other keys are not using — at most
`floor(ADMISSION_HEADROOM × capacity)` slots — when

- its key already holds its fair share of the pool and more than any other key holds there, or
- a key of a higher class (interactive over standard over batch) is active — except while its
  class holds fewer than `ADMISSION_LOWER_CLASS_FLOOR` slots of the pool: then it may take any
  free slot, headroom included. Beyond its floor it leaves at least
  `ADMISSION_LOWER_CLASS_HEADROOM` of the pool free, however much of their shares the higher
  keys use at that instant: their Poisson bursts take them past their shares just when their
  unused part is smallest (bench/tenants.py, a batch key at its share beside equal keys at half
  theirs and a capped flooder: the equal keys' time to first token p99 2.2–5.1 × solo without it,
  0.74–1.25 × at 0.25, for 150 batch requests served instead of 155).

("More than any other key" keeps a well-behaved key whose arrivals bunched up for a moment — a
Poisson stream at half its share is over it a seventh of the time — from being treated like the
flood: only the largest holder gives way. bench/tenants.py: keys at half a share each queued at
p90 0.27–0.34 s with the share alone. And a lower class's unused share is not kept from a higher
class: strict priority across classes stands. But the headroom is capacity left idle, and a
lower class must not starve while capacity sits idle: beside a flood of a higher class, the
headroom was the only free capacity there was, and bench/tenants.py's batch key got 0 of 20
requests. So each lower class may hold `ADMISSION_LOWER_CLASS_FLOOR` slots (default 1) of it: at
most that much of the higher keys' reserve, whatever the number of lower-class keys. Held to
that, a lower class's keys do not count in the higher keys' shares either: beside a batch key, a
flood of standard keys kept only 32 / 6 slots free for each quiet standard key instead of 32 / 5,
and their bursts queued: bench/tenants.py's `admission` phase, their time queued p99 up to 37 ms
before, ≤ 3.5 ms after, the batch key's larger part of the pool taken from the flood.)

Everyone else — a key under its share, of the highest active class — may take any free slot.
So a flood fills the pool only up to what the other keys may claim at once, and a quiet key's
next request finds a slot instead of queueing behind the flood. Keys that use their whole share
leave nothing to keep (the pool is then shared by the queue's order alone), a single active key
is never held back, and the cap rounds down (a pool of fewer than 1 / ADMISSION_HEADROOM slots
keeps none), so small pools and lone tenants lose nothing; the price is up to
`ADMISSION_HEADROOM` of a busy multi-tenant pool left idle for arrivals.

A key is *active* while it holds a slot here, waits for one, or asked for one in the last
`ADMISSION_ACTIVE_FLOW_S`. Like the queue's order, this is each process's own view: holdings and
activity are counted per process (a key's share across processes is its share in each), while
the slots themselves stay exact across processes (`workers.admission.capacity`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Hashable, Iterable

from django.conf import settings

from workers.admission.queue import Priority, Ticket
from workers.cluster.registry import EndpointInfo

__all__ = ["Activity", "activity", "free_slots", "slots_to_keep"]


class Activity:
    """Who asked for each resource lately and what they hold there, in this process."""

    def __init__(self) -> None:
        # resource → flow → (last asked or released, its class)
        self._seen: dict[Hashable, dict[str, tuple[float, Priority]]] = {}
        # resource → flow → capped slots held
        self._held: dict[Hashable, Counter[str]] = {}

    def asked(self, resource: Hashable, ticket: Ticket, now: float) -> None:
        self._seen.setdefault(resource, {})[ticket.flow] = (now, ticket.priority)

    def took(self, resource: Hashable, flow: str) -> None:
        self._held.setdefault(resource, Counter())[flow] += 1

    def released(self, resource: Hashable, flow: str) -> None:
        held = self._held.get(resource)
        if held is None or held[flow] <= 0:
            return
        held[flow] -= 1
        if held[flow] <= 0:
            del held[flow]
        seen = self._seen.get(resource)
        if seen is not None and flow in seen:
            # A holder was active until now: its release keeps it in the window.
            seen[flow] = (time.monotonic(), seen[flow][1])

    def held(self, resource: Hashable, flow: str) -> int:
        held = self._held.get(resource)
        return held[flow] if held is not None else 0

    def held_by_class(self, resource: Hashable, priority: Priority) -> int:
        held = self._held.get(resource)
        if not held:
            return 0
        seen = self._seen.get(resource, {})
        return sum(n for flow, n in held.items() if flow in seen and seen[flow][1] == priority)

    def most_held_by_others(self, resource: Hashable, flow: str) -> int:
        held = self._held.get(resource)
        return max((n for f, n in held.items() if f != flow), default=0) if held else 0

    def active(self, resource: Hashable, now: float, waiting: Iterable[str] = ()) -> dict[str, Priority]:
        """The active flows with their class; forgets the ones gone quiet."""
        seen = self._seen.get(resource)
        if not seen:
            return {}
        held = self._held.get(resource, Counter())
        waiting = set(waiting)
        horizon = now - settings.ADMISSION_ACTIVE_FLOW_S
        quiet = [f for f, (t, _) in seen.items() if t < horizon and not held[f] and f not in waiting]
        for flow in quiet:
            del seen[flow]
        return {flow: priority for flow, (_, priority) in seen.items()}


activity = Activity()


def slots_to_keep(resource: Hashable, ticket: Ticket, capacity: int, now: float, waiting: Iterable[str] = ()) -> int:
    """How many of the resource's `capacity` slots the request must leave free (0: it may take
    any free slot): the part of their shares the other active keys are not using, up to the
    headroom."""
    most = math.floor(settings.ADMISSION_HEADROOM * capacity)
    if most <= 0:
        return 0
    active = activity.active(resource, now, waiting)
    if len(active) < 2 or ticket.flow not in active:
        return 0
    # A share is of what the request's class may claim: a lower class is held to its floor and its
    # headroom beside a higher one, so its keys do not thin out the higher keys' shares.
    share = capacity / sum(1 for priority in active.values() if priority <= ticket.priority)
    outranked = any(priority < ticket.priority for flow, priority in active.items() if flow != ticket.flow)
    if outranked and activity.held_by_class(resource, ticket.priority) < settings.ADMISSION_LOWER_CLASS_FLOOR:
        return 0  # the lower class's floor: idle headroom is not kept from it
    after = activity.held(resource, ticket.flow) + 1
    if not outranked and not (after > share and after > activity.most_held_by_others(resource, ticket.flow)):
        return 0
    # A lower class's unused share is not kept from a higher one (strict priority across classes).
    unclaimed = sum(
        max(0.0, share - activity.held(resource, flow))
        for flow, priority in active.items()
        if flow != ticket.flow and priority <= ticket.priority
    )
    keep = math.ceil(unclaimed - 1e-9)
    if outranked:
        # The higher classes' unused shares are smallest exactly when their own bursts take them
        # past their shares, and a lower class that fills the pool then makes them queue: it
        # leaves at least this much free whatever their holdings.
        keep = max(keep, math.floor(settings.ADMISSION_LOWER_CLASS_HEADROOM * capacity))
    return min(most, keep)


def free_slots(endpoints: Iterable[EndpointInfo], held_here: Iterable[int]) -> int:
    """Free slots on capped endpoints as this process sees them (its own plus the others' at the
    last registry refresh)."""
    return sum(max(0, e.capacity - held - e.remote_open) for e, held in zip(endpoints, held_here, strict=True) if e.capacity is not None)
