"""The admission queue's order, bounds and exits, driven in-process: strict priority, fair share in
tokens across keys and sessions (virtual token counter), FIFO inside a session, a full queue and
an expired wait refused, a cancelled waiter gone at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.test import override_settings

from workers.admission.queue import AdmissionQueue, AdmissionRefused, Priority, Ticket

RESOURCE = ("pool", "generation")


class Slots:
    """One resource with `free` slots, served through a queue the way `workers.admission.admit`
    does: try, else wait your turn; the order of admissions is recorded."""

    def __init__(self, queue: AdmissionQueue, free: int = 0) -> None:
        self.queue = queue
        self.free = free
        self.admitted: list[str] = []

    async def request(self, name: str, ticket: Ticket, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if not self.queue.busy(RESOURCE) and self.free:
            self.free -= 1
            self.admitted.append(name)
            self.queue.charge(ticket, ticket.tokens)
            return
        waiter = await self.queue.wait_turn(RESOURCE, ticket, deadline)
        while not self.free:
            await self.queue.wait_again(waiter, deadline)
        self.free -= 1
        self.admitted.append(name)
        self.queue.charge(ticket, ticket.tokens)
        self.queue.leave(waiter)

    def release(self, n: int = 1) -> None:
        self.free += n
        for _ in range(n):
            self.queue.notify(RESOURCE)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def enqueue(slots: Slots, requests: list[tuple[str, Ticket]]) -> list[asyncio.Task[None]]:
    tasks = []
    for name, ticket in requests:
        tasks.append(asyncio.create_task(slots.request(name, ticket)))
        await settle()  # arrival order is the list's
    return tasks


async def drain(slots: Slots, tasks: list[asyncio.Task[None]]) -> list[str]:
    while not all(t.done() for t in tasks):
        slots.release()
        await settle()
    await asyncio.gather(*tasks)
    return slots.admitted


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_a_higher_class_goes_first_and_a_class_is_fifo_for_one_key() -> None:
    slots = Slots(AdmissionQueue())
    tasks = await enqueue(slots, [
        ("batch-1", Ticket("b", priority=Priority.BATCH)),
        ("std-1", Ticket("s", priority=Priority.STANDARD)),
        ("batch-2", Ticket("b", priority=Priority.BATCH)),
        ("int-1", Ticket("i", priority=Priority.INTERACTIVE)),
        ("std-2", Ticket("s", priority=Priority.STANDARD)),
    ])
    assert await drain(slots, tasks) == ["int-1", "std-1", "std-2", "batch-1", "batch-2"]


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_keys_share_in_tokens_not_requests() -> None:
    """A key sending big prompts gets as many tokens as one sending small ones, not as many requests."""
    slots = Slots(AdmissionQueue())
    requests = [(f"big-{i}", Ticket("big", tokens=4000)) for i in range(4)]
    requests += [(f"small-{i}", Ticket("small", tokens=1000)) for i in range(12)]
    order = await drain(slots, await enqueue(slots, requests))
    # While both wait, each big request is followed by about four small ones.
    first_eight = order[:10]
    assert sum(name.startswith("big") for name in first_eight) == 2, order
    tokens = {"big": 0, "small": 0}
    for name in order[:10]:
        tokens[name.split("-")[0]] += 4000 if name.startswith("big") else 1000
    assert abs(tokens["big"] - tokens["small"]) <= 4000, (tokens, order)


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_sessions_of_one_key_take_turns() -> None:
    slots = Slots(AdmissionQueue())
    requests = [(f"a{i}", Ticket("k", session="a", tokens=100)) for i in range(3)]
    requests += [(f"b{i}", Ticket("k", session="b", tokens=100)) for i in range(3)]
    order = await drain(slots, await enqueue(slots, requests))
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_idle_time_banks_no_credit() -> None:
    """A key that was served little long ago does not jump ahead of everyone when it returns."""
    queue = AdmissionQueue()
    queue.charge(Ticket("busy"), 1_000_000)
    slots = Slots(queue)
    requests = [(f"busy-{i}", Ticket("busy", tokens=100)) for i in range(3)]
    requests += [(f"other-{i}", Ticket("other", tokens=100)) for i in range(3)]
    order = await drain(slots, await enqueue(slots, requests))
    # "busy" arrived first and was lifted only against what is waiting: "other" joins at busy's
    # counter, so they alternate instead of "other" taking every slot first.
    assert order[:2] == ["busy-0", "other-0"] or order[:2] == ["other-0", "busy-0"], order
    assert order.index("busy-1") < order.index("other-2"), order


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_a_newcomer_queues_behind_waiters_even_when_a_slot_frees() -> None:
    slots = Slots(AdmissionQueue())
    tasks = await enqueue(slots, [("first", Ticket("a"))])
    slots.free = 1  # freed without a notification: the waiter has not run yet
    late = asyncio.create_task(slots.request("late", Ticket("b")))
    await settle()
    assert slots.admitted == []  # the newcomer did not take it past the waiter
    await drain(slots, [*tasks, late])
    assert slots.admitted == ["first", "late"]


@override_settings(ADMISSION_QUEUE_MAX_REQUESTS=2, ADMISSION_POLL_INTERVAL_S=60)
async def test_a_full_queue_refuses_at_once_with_a_retry_after() -> None:
    slots = Slots(AdmissionQueue())
    tasks = await enqueue(slots, [("a", Ticket("a")), ("b", Ticket("b"))])
    with pytest.raises(AdmissionRefused) as refused:
        await slots.request("c", Ticket("c"))
    assert refused.value.status == 529 and 0 < (refused.value.retry_after or 0) <= 59
    await drain(slots, tasks)


@override_settings(ADMISSION_QUEUE_MAX_BYTES=1000, ADMISSION_POLL_INTERVAL_S=60)
async def test_the_queue_is_bounded_in_bytes() -> None:
    slots = Slots(AdmissionQueue())
    tasks = await enqueue(slots, [("a", Ticket("a", size=800))])
    with pytest.raises(AdmissionRefused):
        await slots.request("b", Ticket("b", size=300))
    await drain(slots, tasks)


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_an_expired_wait_leaves_the_queue_and_passes_its_turn() -> None:
    queue = AdmissionQueue()
    slots = Slots(queue)
    with pytest.raises(AdmissionRefused) as refused:
        await slots.request("patient", Ticket("a"), timeout=0.05)
    assert "no worker slot freed" in refused.value.message
    assert queue.depth() == 0 and not queue.busy(RESOURCE)


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_a_cancelled_waiter_is_gone_at_once_and_the_next_one_is_served() -> None:
    queue = AdmissionQueue()
    slots = Slots(queue)
    tasks = await enqueue(slots, [("leaves", Ticket("a")), ("stays", Ticket("b"))])
    slots.free = 1
    queue.notify(RESOURCE)  # "leaves" is woken to try...
    tasks[0].cancel()  # ...and its client goes away before it runs
    await asyncio.wait({tasks[0]})
    await settle()
    assert slots.admitted == ["stays"]  # the turn passed on without another notification
    assert queue.depth() == 0
    await tasks[1]


async def test_the_head_polls_for_slots_freed_elsewhere() -> None:
    """A slot freed in another process sends no notification: the head looks again on its own."""
    with override_settings(ADMISSION_POLL_INTERVAL_S=0.01):
        slots = Slots(AdmissionQueue())
        task = asyncio.create_task(slots.request("waiting", Ticket("a")))
        await settle()
        slots.free = 1  # no notify
        await asyncio.wait_for(task, 2)
    assert slots.admitted == ["waiting"]


def test_a_keys_priority_is_stored_as_its_admission_class_label() -> None:
    from messages_api.models import ApiKey

    field = ApiKey._meta.get_field("priority")
    # The values existing rows hold: the one enum must keep reading them.
    assert [value for value, _ in field.choices] == ["interactive", "standard", "batch"]
    assert [Priority.from_label(value) for value, _ in field.choices] == list(Priority)
    assert Priority.from_label(field.default) is Priority.STANDARD




@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_a_slot_freed_while_the_head_is_trying_is_not_missed() -> None:
    """The head is woken, tries (another request took the slot), and a second slot frees before it
    waits again: it tries again at once instead of waiting for the next poll."""
    queue = AdmissionQueue()
    loop = asyncio.get_running_loop()
    waiter = await asyncio.wait_for(_woken(queue), 1)
    queue.notify(RESOURCE)  # freed again while the head is "trying"
    started = loop.time()
    await queue.wait_again(waiter, loop.time() + 5)  # returns at once: no lost wake-up
    assert loop.time() - started < 0.5
    queue.leave(waiter)


async def _woken(queue: AdmissionQueue) -> Any:
    task = asyncio.create_task(queue.wait_turn(RESOURCE, Ticket("a"), asyncio.get_running_loop().time() + 5))
    await settle()
    queue.notify(RESOURCE)
    return await task


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_on_wait_is_awaited_once_when_the_request_waits_and_not_when_it_goes_through() -> None:
    # A streamed request starts its answer as it joins the queue (ChatRun.stream_ready's on_wait).
    slots = Slots(AdmissionQueue(), free=1)
    started: list[str] = []

    def ticket(name: str) -> Ticket:
        t = Ticket(name)

        async def on_wait() -> None:
            started.append(name)
            t.on_wait = None  # once, as ChatRun's does

        t.on_wait = on_wait
        return t

    tasks = await enqueue(slots, [("through", ticket("through")), ("waits", ticket("waits"))])
    assert started == ["waits"] and slots.admitted == ["through"]
    assert await drain(slots, tasks) == ["through", "waits"]
    assert started == ["waits"]


@override_settings(ADMISSION_POLL_INTERVAL_S=60)
async def test_an_on_wait_that_fails_leaves_no_place_in_the_queue() -> None:
    queue = AdmissionQueue()
    slots = Slots(queue)

    async def client_gone() -> None:
        raise ConnectionResetError("the client left")

    with pytest.raises(ConnectionResetError):
        await slots.request("gone", Ticket("gone", on_wait=client_gone))
    assert queue.depth() == 0 and not queue.busy(RESOURCE)
