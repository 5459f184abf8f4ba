"""The headroom rule, driven through `workers.admission.admit` on an in-process pool: a key that
floods a capped pool fills it only up to the headroom while another key is active, so the other
key's next request takes a slot at once instead of waiting for a release; a lone key, and a pool
too small to keep any headroom, lose nothing; a lower class leaves the headroom to a higher one."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
from django.test import override_settings

from workers.admission import Priority, Ticket, activity, admit
from workers.admission.headroom import slots_to_keep
from workers.admission.queue import AdmissionRefused, notify_freed
from workers.cluster.registry import EndpointInfo

_ids = itertools.count(70_000)
_names = itertools.count()


class Pool:
    """`endpoints` × `capacity` slots of one resource; holdings counted as the router's ledger
    and reservations count them."""

    def __init__(self, endpoints: int = 2, capacity: int = 4) -> None:
        name = f"headroom-{next(_names)}"
        self.resource = (name, "generation")
        self.endpoints = [
            EndpointInfo(id=next(_ids), pool_name=name, role="generation", url=f"http://{name}-{i}", enabled=True,
                         draining=False, healthy=True, capacity=capacity)
            for i in range(endpoints)
        ]
        self.open: Counter[int] = Counter()
        self.held: Counter[str] = Counter()

    def held_here(self, endpoint_id: int) -> tuple[int, int]:
        return self.open[endpoint_id], 0

    async def take(self, flow: str, priority: Priority = Priority.STANDARD) -> EndpointInfo:
        endpoint, _ = await admit(
            self.resource, Ticket(flow, priority=priority, tokens=100), lambda fresh: self.endpoints,
            lambda roomy: min(roomy, key=lambda e: self.open[e.id]), tokens=0, held_here=self.held_here,
        )
        self.open[endpoint.id] += 1
        self.held[flow] += 1
        activity.took(self.resource, flow)
        return endpoint

    def release(self, endpoint: EndpointInfo, flow: str) -> None:
        self.open[endpoint.id] -= 1
        self.held[flow] -= 1
        activity.released(self.resource, flow)
        notify_freed(self.resource)


class Flood:
    """A key keeping `n` requests outstanding; each holds its slot until `finish_one` ends it."""

    def __init__(self, pool: Pool, flow: str, n: int, priority: Priority = Priority.STANDARD) -> None:
        self.pool, self.flow, self.priority = pool, flow, priority
        self.holding: list[EndpointInfo] = []
        self.tasks = [asyncio.create_task(self._one()) for _ in range(n)]

    async def _one(self) -> None:
        self.holding.append(await self.pool.take(self.flow, self.priority))

    def finish_one(self) -> None:
        self.pool.release(self.holding.pop(0), self.flow)
        self.tasks.append(asyncio.create_task(self._one()))  # closed loop: the next one asks

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


async def settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


async def admitted_at_once(pool: Pool, flow: str, priority: Priority = Priority.STANDARD) -> EndpointInfo | None:
    task = asyncio.create_task(pool.take(flow, priority))
    await settle()
    if task.done():
        return task.result()
    task.cancel()
    return None


SETTINGS = dict(ADMISSION_HEADROOM=0.25, ADMISSION_ACTIVE_FLOW_S=60, ADMISSION_POLL_INTERVAL_S=60, ADMISSION_QUEUE_TIMEOUT_S=5)


@override_settings(**SETTINGS)
async def test_a_lone_key_fills_the_pool() -> None:
    pool = Pool()
    flood = Flood(pool, "noisy", 20)
    await settle()
    assert pool.held["noisy"] == 8
    flood.stop()


@override_settings(**SETTINGS)
async def test_a_flood_leaves_the_headroom_to_an_active_key() -> None:
    pool = Pool()  # 8 slots, headroom 2
    flood = Flood(pool, "noisy", 20)
    await settle()
    assert pool.held["noisy"] == 8
    # The quiet key asks while the pool is full: it waits, first in the queue's order.
    quiet = asyncio.create_task(pool.take("quiet"))
    await settle()
    assert not quiet.done()
    flood.finish_one()
    await settle()
    assert quiet.done(), "a freed slot goes to the key under its share, ahead of the flood's waiters"
    pool.release(quiet.result(), "quiet")
    # The flood's releases now refill the pool only up to the headroom (8 - 2)...
    for _ in range(4):
        flood.finish_one()
        await settle()
    assert pool.held["noisy"] == 6
    # ...so each of the quiet key's requests finds a slot at once, up to the headroom.
    first = await admitted_at_once(pool, "quiet")
    second = await admitted_at_once(pool, "quiet")
    assert first is not None and second is not None
    assert await admitted_at_once(pool, "quiet") is None  # past the headroom it waits like anyone
    flood.stop()


def active_keys(pool: Pool, holdings: dict[str, int]) -> float:
    """Each key active on the pool (it asked a moment ago) and holding so many slots; the time."""
    now = asyncio.get_running_loop().time()
    for flow, held in holdings.items():
        activity.asked(pool.resource, Ticket(flow), now)
        for _ in range(held):
            activity.took(pool.resource, flow)
    return now


@override_settings(**SETTINGS)
async def test_a_key_under_its_share_takes_any_free_slot() -> None:
    pool = Pool()
    # Two active keys: a share is 4 slots; holding 3, a fourth is within it.
    now = active_keys(pool, {"a": 3, "b": 0})
    assert slots_to_keep(pool.resource, Ticket("a"), 8, now) == 0
    activity.took(pool.resource, "a")
    assert slots_to_keep(pool.resource, Ticket("a"), 8, now) == 2


@override_settings(**SETTINGS)
async def test_only_the_largest_holder_gives_way() -> None:
    pool = Pool()
    # The quiet key is over its share of 4 for a moment (a burst); the flood holds more.
    now = active_keys(pool, {"quiet": 5, "flood": 6, "idle": 0})
    assert slots_to_keep(pool.resource, Ticket("quiet"), 12, now) == 0
    # The flood leaves the idle key's unused share (4), capped at the headroom (25 % of 12).
    assert slots_to_keep(pool.resource, Ticket("flood"), 12, now) == 3


@override_settings(**SETTINGS)
async def test_keys_using_their_whole_share_leave_nothing_to_keep() -> None:
    pool = Pool()
    now = active_keys(pool, {"a": 4, "b": 4})
    assert slots_to_keep(pool.resource, Ticket("b"), 8, now) == 0  # a claims its whole share: nothing idles for it


@override_settings(**SETTINGS)
async def test_a_lower_class_leaves_the_headroom_to_a_higher_one() -> None:
    pool = Pool()
    await pool.take("interactive", Priority.INTERACTIVE)  # active, holding one slot
    batch = Flood(pool, "batch", 20, Priority.BATCH)
    await settle()
    assert pool.held["batch"] == 5  # 8 slots - 1 held - 2 of headroom
    assert await admitted_at_once(pool, "interactive", Priority.INTERACTIVE) is not None
    batch.stop()


@override_settings(**{**SETTINGS, "ADMISSION_HEADROOM": 0.1})
async def test_a_pool_too_small_for_a_whole_slot_keeps_none() -> None:
    pool = Pool(endpoints=1, capacity=8)  # 10 % of 8 rounds down to 0
    await pool.take("quiet")
    flood = Flood(pool, "noisy", 20)
    await settle()
    assert pool.held["noisy"] == 7
    flood.stop()


@override_settings(**{**SETTINGS, "ADMISSION_ACTIVE_FLOW_S": 0.0})
async def test_a_key_gone_quiet_no_longer_holds_the_headroom() -> None:
    pool = Pool()
    endpoint = await pool.take("quiet")
    pool.release(endpoint, "quiet")
    flood = Flood(pool, "noisy", 20)
    await settle()
    assert pool.held["noisy"] == 8  # the quiet key holds nothing and its window is over
    flood.stop()


@override_settings(**{**SETTINGS, "ADMISSION_QUEUE_TIMEOUT_S": 0.2})
async def test_a_held_back_wait_still_ends_in_a_refusal() -> None:
    pool = Pool()
    await pool.take("quiet")
    flood = Flood(pool, "noisy", 6)
    await settle()
    assert pool.held["noisy"] == 5  # 8 - 1 - 2
    with pytest.raises(AdmissionRefused):
        await asyncio.gather(*flood.tasks)
    flood.stop()


@override_settings(**SETTINGS)
async def test_a_lower_classs_unused_share_is_not_kept_from_a_higher_one() -> None:
    pool = Pool()
    now = asyncio.get_running_loop().time()
    activity.asked(pool.resource, Ticket("standard"), now)
    activity.asked(pool.resource, Ticket("batch", priority=Priority.BATCH), now)
    for _ in range(4):
        activity.took(pool.resource, "standard")  # at its share; the batch key holds nothing
    assert slots_to_keep(pool.resource, Ticket("standard"), 8, now) == 0
    assert slots_to_keep(pool.resource, Ticket("batch", priority=Priority.BATCH), 8, now) == 0  # nothing unused above it


@override_settings(**SETTINGS)
async def test_a_lower_class_takes_its_floor_out_of_the_idle_headroom() -> None:
    pool = Pool()  # 8 slots, headroom 2
    await pool.take("quiet")  # a standard key, active, holding one slot
    noisy = Flood(pool, "noisy", 20)
    await settle()
    assert pool.held["noisy"] == 5  # 8 - 1 - the quiet key's unused share (2)
    batch = Flood(pool, "batch", 20, Priority.BATCH)
    await settle()
    # Beside the standard flood the only free capacity is the headroom: the batch class takes
    # its floor of it (one slot), not more.
    assert pool.held["batch"] == 1
    # The batch key's slot frees: the standard flood, first in order, is held back and passes
    # the turn; the batch key's next request takes the slot again.
    batch.finish_one()
    await settle()
    assert pool.held == Counter({"noisy": 5, "batch": 1, "quiet": 1})
    # The flood's own slot frees: the flood must leave the headroom whole again, so the batch
    # class's floor comes out of the flood's part, not the quiet key's.
    noisy.finish_one()
    await settle()
    assert pool.held == Counter({"noisy": 4, "batch": 1, "quiet": 1})
    assert await admitted_at_once(pool, "quiet") is not None
    assert await admitted_at_once(pool, "quiet") is not None
    noisy.stop()
    batch.stop()


@override_settings(**{**SETTINGS, "ADMISSION_LOWER_CLASS_FLOOR": 0})
async def test_without_a_floor_a_lower_class_waits_behind_a_higher_ones_flood() -> None:
    pool = Pool()
    await pool.take("quiet")
    noisy = Flood(pool, "noisy", 20)
    await settle()
    batch = Flood(pool, "batch", 20, Priority.BATCH)
    await settle()
    assert pool.held["batch"] == 0 and pool.held["noisy"] == 5
    noisy.finish_one()
    await settle()
    assert pool.held["batch"] == 0 and pool.held["noisy"] == 5
    noisy.stop()
    batch.stop()


@override_settings(**{**SETTINGS, "ADMISSION_LOWER_CLASS_FLOOR": 2})
async def test_the_floor_is_per_class_not_per_key() -> None:
    pool = Pool(endpoints=4)  # 16 slots, headroom 4
    now = active_keys(pool, {"standard": 1, "b1": 1, "b2": 0})
    for flow in ("b1", "b2"):
        activity.asked(pool.resource, Ticket(flow, priority=Priority.BATCH), now)
    b2 = Ticket("b2", priority=Priority.BATCH)
    assert slots_to_keep(pool.resource, b2, 16, now) == 0  # the batch class holds 1 of its 2
    activity.took(pool.resource, "b1")
    assert slots_to_keep(pool.resource, b2, 16, now) == 4  # 2 of 2: b2 leaves the headroom like any outranked key


@override_settings(**{**SETTINGS, "ADMISSION_HEADROOM": 0.5, "ADMISSION_LOWER_CLASS_HEADROOM": 0.25})
async def test_beyond_its_floor_a_lower_class_leaves_room_for_the_higher_ones_bursts() -> None:
    pool = Pool(endpoints=4)  # 16 slots
    now = active_keys(pool, {"a": 6, "b": 6, "batch": 1})  # a and b past their shares (16 / 3): a burst
    activity.asked(pool.resource, Ticket("batch", priority=Priority.BATCH), now)
    batch = Ticket("batch", priority=Priority.BATCH)
    # Nothing of the higher keys' shares is unused, yet the batch key leaves a quarter of the pool.
    assert slots_to_keep(pool.resource, batch, 16, now) == 4
    assert slots_to_keep(pool.resource, Ticket("a"), 16, now) == 0  # a higher key is not held to it
    with override_settings(ADMISSION_LOWER_CLASS_HEADROOM=0.0):
        assert slots_to_keep(pool.resource, batch, 16, now) == 0  # only the unused shares: none


@override_settings(**{**SETTINGS, "ADMISSION_HEADROOM": 0.5})
async def test_a_lower_class_does_not_thin_out_the_higher_keys_shares() -> None:
    pool = Pool(endpoints=4)  # 16 slots, headroom 8
    now = active_keys(pool, {"flood": 9, "quiet": 0, "batch": 1})
    activity.asked(pool.resource, Ticket("batch", priority=Priority.BATCH), now)
    # The batch key is held to its floor and its headroom beside the standard keys, so it does not
    # count in their shares: a share is 16 / 2, not 16 / 3, and the flood leaves all 8 of the
    # quiet key's (capped at the headroom), not 6.
    assert slots_to_keep(pool.resource, Ticket("flood"), 16, now) == 8
    # Seen from the batch class, every active key shares the pool: 16 / 3 each.
    assert slots_to_keep(pool.resource, Ticket("batch", priority=Priority.BATCH), 16, now) == 6
