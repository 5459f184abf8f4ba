"""The admission queue: requests that found every suitable endpoint at capacity wait here, in the
gateway, for the first slot that frees, instead of in an engine's queue where they would be
committed to one worker before anyone knows which frees first.

Order, when a slot frees on a resource (a pool's role):

1. **Strict priority** across classes (`Priority`: interactive, standard, batch). The queue is
   work-conserving: a slot never stays idle while anyone waits for it, so a lower class waits
   only while a higher one is waiting for the same slots. (The headroom keeps some slots idle for
   quiet keys; a lower class holds `ADMISSION_LOWER_CLASS_FLOOR` of them, so it never starves
   while they sit idle: `workers.admission.headroom`.)
2. **Fair share in tokens** inside a class, across keys (flows) and, inside a key, across its
   sessions: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
   Models", OSDI 2024), as AIBrix uses it. Each flow has a counter of the tokens it was served
   (its prompts when admitted, its output when done); the waiting flow with the smallest counter
   goes next. A flow that starts waiting is lifted to the smallest counter among the flows
   already waiting, so idle time banks no credit and a newcomer cannot starve the others. Tokens,
   not requests: one key's 100k-token prompts cost it what they cost the cluster. Chosen over
   deficit round robin because service is known only afterwards (output length), which VTC
   charges when it is known, and it needs no quantum tuned to request sizes.
3. First come, first served inside a session.

Bounded by count and bytes (`ADMISSION_QUEUE_MAX_REQUESTS`, `ADMISSION_QUEUE_MAX_BYTES`), and in
time (`ADMISSION_QUEUE_TIMEOUT_S`): past any bound, `AdmissionRefused` (529 at the front door).
A waiter whose client leaves is cancelled and leaves the queue at once.

Counters and order are this process's: with several gateway processes each orders its own
waiters, and the slots themselves (`workers.admission.capacity`) are shared exactly.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

from django.conf import settings
from prometheus_client import Counter, Gauge, Histogram

from workers.exceptions import NoEndpointAvailable


class Priority(enum.IntEnum):
    """A request's class in the admission queue; lower values go first. The one priority enum:
    an API key's class (`messages_api.models.ApiKey.priority`) is stored as its `label` and read
    back with `from_label`, and the metrics label the queue with it."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        """The class's name as stored, shown and labelled: "interactive", "standard", "batch"."""
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> Priority:
        """The class whose `label` this is; KeyError if none."""
        return cls[label.upper()]

    @classmethod
    def choices(cls) -> list[tuple[str, str]]:
        """`(label, label)` of every class, highest first (a model field's `choices`)."""
        return [(priority.label, priority.label) for priority in cls]


queue_depth = Gauge("gateway_admission_queue_depth", "Requests waiting for an endpoint slot, by priority class.", ["priority"])
queue_wait = Histogram(
    "gateway_admission_wait_seconds",
    "Time requests waited in the admission queue, by priority class and how the wait ended.",
    ["priority", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
refusals = Counter("gateway_admission_refusals", "Requests refused by the admission queue, by priority class and reason.", ["priority", "reason"])


class AdmissionRefused(NoEndpointAvailable):
    """The request waited as long as it may, or the queue is full: the service is overloaded."""


@dataclass(slots=True)
class Ticket:
    """Who is asking, for the queue's order: a flow (the API key) and its session."""

    flow: str = ""
    session: str = ""
    priority: Priority = Priority.STANDARD
    #: Tokens charged to the flow's counter when admitted (the prompt).
    tokens: int = 0
    #: Bytes the request holds while it waits (its body), for the queue's byte bound.
    size: int = 0
    #: Awaited when the request is about to wait for its turn (a streamed answer starts then).
    on_wait: Callable[[], Awaitable[None]] | None = field(default=None, repr=False, compare=False)


@dataclass(slots=True, eq=False)
class _Waiter:
    ticket: Ticket
    resource: Hashable
    future: asyncio.Future[None]
    enqueued: float = field(default_factory=time.monotonic)
    #: A slot freed again while the woken waiter was still trying: it tries once more at once.
    rewoken: bool = False


class _Flow:
    """A flow's waiting sessions; each session's waiters first come, first served."""

    __slots__ = ("sessions",)

    def __init__(self) -> None:
        self.sessions: dict[str, deque[_Waiter]] = {}


class AdmissionQueue:
    """Waiters by resource, then priority, then flow, then session."""

    def __init__(self) -> None:
        # resource → priority → flow → sessions (insertion order breaks counter ties: FIFO)
        self._waiting: dict[Hashable, dict[Priority, dict[str, _Flow]]] = {}
        self._flow_counter: dict[str, float] = {}
        self._session_counter: dict[tuple[str, str], float] = {}
        self._count = 0
        self._bytes = 0
        # Waiters by (resource, class): kept as they come and go, so another thread (the admin's
        # cluster overview) reads a copy without walking the queue while the loop changes it.
        self.waiting: collections.Counter[tuple[Hashable, Priority]] = collections.Counter()
        self._order = itertools.count()
        self._pollers: dict[Hashable, asyncio.TimerHandle] = {}
        # (resource, flow) whose last try was refused only to keep the headroom
        # (`workers.admission.headroom`): they go after the flows of their class a free slot can
        # serve.
        self._held_back: set[tuple[Hashable, str]] = set()
        # resource → flows that tried since the last `notify` there. A try refused for the
        # headroom passes the turn to the next flow in order that has not tried (each flow tries
        # at most once per freed slot, so held-back flows cannot wake each other in turn for
        # nothing, and a lower class still gets its try when every flow above it is held back).
        self._tried: dict[Hashable, set[str]] = {}

    # --- what callers use --------------------------------------------------------------------

    def busy(self, resource: Hashable) -> bool:
        """Whether requests wait for `resource`: a newcomer queues behind them, never past."""
        return resource in self._waiting

    def waiting_flows(self, resource: Hashable) -> list[str]:
        """The flows with requests waiting for `resource`, any class."""
        return [flow for flows in self._waiting.get(resource, {}).values() for flow in flows]

    def hold_back(self, resource: Hashable, flow: str, held_back: bool) -> None:
        """The flow tried for a slot; `held_back`: it was refused only to keep the headroom. While
        it is, the flow's waiters go after the others of their class."""
        if resource in self._waiting:
            self._tried.setdefault(resource, set()).add(flow)
        if held_back:
            self._held_back.add((resource, flow))
            # The turn passes to the next waiter in order that has not tried for this slot.
            waiter = self._next(resource, untried=True)
            if waiter is not None:
                self._wake(waiter)
        else:
            self._held_back.discard((resource, flow))

    def depth(self, priority: Priority | None = None) -> int:
        return sum(
            len(waiters)
            for classes in self._waiting.values()
            for p, flows in classes.items()
            if priority is None or p == priority
            for flow in flows.values()
            for waiters in flow.sessions.values()
        )

    async def wait_turn(self, resource: Hashable, ticket: Ticket, deadline: float) -> _Waiter:
        """Join the queue and wait until it is this request's turn to try for a slot.

        The caller tries, then either `leave()`s (admitted, or giving up) or calls `wait_again()`
        (someone elsewhere took the slot first); its place is kept meanwhile."""
        if self._count >= settings.ADMISSION_QUEUE_MAX_REQUESTS or self._bytes + ticket.size > settings.ADMISSION_QUEUE_MAX_BYTES:
            refusals.labels(ticket.priority.label, "queue_full").inc()
            self._held_back.discard((resource, ticket.flow))
            raise _refused("the gateway's admission queue is full")
        waiter = _Waiter(ticket, resource, asyncio.get_running_loop().create_future())
        self._enqueue(waiter)
        if self._next(resource, untried=True) is waiter:
            # First in order among the flows that have not tried since the last release (a key
            # that was served less, one ahead of held-back flows, a lower class whose betters
            # were all held back): it tries now rather than at the next release; a free slot may
            # be one the others must leave.
            # (Its turn is marked taken, so a release during the try re-wakes it.)
            waiter.future.set_result(None)
            return waiter
        await self.wait_again(waiter, deadline)
        return waiter

    async def wait_again(self, waiter: _Waiter, deadline: float) -> None:
        if waiter.future.done():
            waiter.future = asyncio.get_running_loop().create_future()
            if waiter.rewoken:
                waiter.rewoken = False
                waiter.future.set_result(None)
        self._poll(waiter.resource)
        on_wait = waiter.ticket.on_wait
        try:
            async with asyncio.timeout_at(deadline):
                if on_wait is not None and not waiter.future.done():
                    await on_wait()
                await waiter.future
        except TimeoutError:
            self.leave(waiter, "expired")
            refusals.labels(waiter.ticket.priority.label, "timeout").inc()
            raise _refused(f"no worker slot freed within {settings.ADMISSION_QUEUE_TIMEOUT_S:g} s") from None
        except BaseException:
            # Cancelled, or the request's `on_wait` failed (its client gone): its place goes.
            self.leave(waiter, "cancelled")
            raise

    def leave(self, waiter: _Waiter, outcome: str = "admitted") -> None:
        """Take the waiter out (idempotent) and let the next one try."""
        classes = self._waiting.get(waiter.resource)
        flow = classes.get(waiter.ticket.priority, {}).get(waiter.ticket.flow) if classes else None
        session = flow.sessions.get(waiter.ticket.session) if flow else None
        if session is None or waiter not in session:
            return
        session.remove(waiter)
        if not session:
            del flow.sessions[waiter.ticket.session]  # type: ignore[union-attr]
            if not flow.sessions:  # type: ignore[union-attr]
                del classes[waiter.ticket.priority][waiter.ticket.flow]  # type: ignore[index]
                self._held_back.discard((waiter.resource, waiter.ticket.flow))
                if not classes[waiter.ticket.priority]:  # type: ignore[index]
                    del classes[waiter.ticket.priority]  # type: ignore[union-attr]
                    if not classes:
                        del self._waiting[waiter.resource]
                        self._tried.pop(waiter.resource, None)
        self._count -= 1
        self._bytes -= waiter.ticket.size
        place = (waiter.resource, waiter.ticket.priority)
        self.waiting[place] -= 1
        if self.waiting[place] <= 0:
            del self.waiting[place]
        label = waiter.ticket.priority.label
        queue_depth.labels(label).dec()
        queue_wait.labels(label, outcome).observe(time.monotonic() - waiter.enqueued)
        if outcome == "admitted" or waiter.future.done():
            # Admitted: another slot may be free too (two released together wake one waiter).
            # Woken and gone instead (cancelled, expired): the turn passes on.
            self.notify(waiter.resource)

    def charge(self, ticket: Ticket, tokens: int) -> None:
        """Count tokens served to the ticket's flow and session (its prompt when admitted, its
        output when known)."""
        if tokens <= 0:
            return
        self._flow_counter[ticket.flow] = self._flow_counter.get(ticket.flow, 0.0) + tokens
        key = (ticket.flow, ticket.session)
        self._session_counter[key] = self._session_counter.get(key, 0.0) + tokens

    def notify(self, resource: Hashable) -> None:
        """A slot may have freed on `resource`: wake the next waiter in order to try for it."""
        self._tried.pop(resource, None)
        waiter = self._next(resource)
        if waiter is not None:
            self._wake(waiter)

    def _wake(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            waiter.rewoken = True  # it is trying now; a failed try must not wait for the next poll
        else:
            waiter.future.set_result(None)

    # --- order -------------------------------------------------------------------------------

    def _enqueue(self, waiter: _Waiter) -> None:
        ticket = waiter.ticket
        classes = self._waiting.setdefault(waiter.resource, {})
        flows = classes.setdefault(ticket.priority, {})
        flow = flows.get(ticket.flow)
        if flow is None:
            # A flow that starts waiting is lifted to the least served of those waiting: no banked credit.
            floor = min((self._flow_counter.get(f, 0.0) for f in flows), default=None)
            if floor is not None and self._flow_counter.get(ticket.flow, 0.0) < floor:
                self._flow_counter[ticket.flow] = floor
            flow = flows[ticket.flow] = _Flow()
        if ticket.session not in flow.sessions:
            floor = min((self._session_counter.get((ticket.flow, s), 0.0) for s in flow.sessions), default=None)
            key = (ticket.flow, ticket.session)
            if floor is not None and self._session_counter.get(key, 0.0) < floor:
                self._session_counter[key] = floor
            flow.sessions[ticket.session] = deque()
        flow.sessions[ticket.session].append(waiter)
        self._count += 1
        self._bytes += ticket.size
        self.waiting[(waiter.resource, ticket.priority)] += 1
        queue_depth.labels(ticket.priority.label).inc()

    def _next(self, resource: Hashable, untried: bool = False) -> _Waiter | None:
        """The next waiter in order: the highest class, then flows not held back, then the least
        served flow and session. `untried`: among the flows that have not tried since the last
        `notify`."""
        classes = self._waiting.get(resource)
        if not classes:
            return None
        held_back = self._held_back
        tried = self._tried.get(resource, ()) if untried else ()
        flow_name = None
        for priority in sorted(classes):
            flows = classes[priority]
            candidates = [f for f in flows if f not in tried]
            if candidates:
                flow_name = min(candidates, key=lambda f: ((resource, f) in held_back, self._flow_counter.get(f, 0.0)))
                break
        if flow_name is None:
            return None
        sessions = flows[flow_name].sessions
        session = min(sessions, key=lambda s: self._session_counter.get((flow_name, s), 0.0))
        return sessions[session][0]

    def _poll(self, resource: Hashable) -> None:
        """While anyone waits for `resource`, look again every ADMISSION_POLL_INTERVAL_S: a slot may
        free in another process, or an operator may raise a capacity."""
        if resource in self._pollers:
            return
        loop = asyncio.get_running_loop()

        def tick() -> None:
            del self._pollers[resource]
            if self.busy(resource):
                self.notify(resource)
                self._poll(resource)

        self._pollers[resource] = loop.call_later(settings.ADMISSION_POLL_INTERVAL_S, tick)


def _refused(message: str) -> AdmissionRefused:
    return AdmissionRefused(
        529, message, stage="admission", code="overloaded", retry_after=settings.ADMISSION_RETRY_AFTER_S
    )


_queues: dict[asyncio.AbstractEventLoop, AdmissionQueue] = {}


def get_queue() -> AdmissionQueue:
    """This event loop's queue."""
    loop = asyncio.get_running_loop()
    queue = _queues.get(loop)
    if queue is None:
        for stale in [other for other in _queues if other.is_closed()]:
            del _queues[stale]
        queue = _queues[loop] = AdmissionQueue()
    return queue


def waiting_here() -> dict[tuple[Hashable, Priority], int]:
    """Requests waiting in this process's queues, by resource (pool, role) and class. Safe from any
    thread: it copies counters that only the queues' loops change."""
    total: collections.Counter[tuple[Hashable, Priority]] = collections.Counter()
    for queue in list(_queues.values()):
        total.update(dict(queue.waiting))
    return dict(total)


def admission_waiting(priority: Priority) -> int:
    """Requests of class `priority` waiting in the running event loop's admission queue, for
    every resource (a producer of lower-class work, such as a batch runner, starts more only while
    few of its own wait)."""
    queue = _queues.get(asyncio.get_running_loop())
    if queue is None:
        return 0
    return sum(count for (_, waiting_class), count in queue.waiting.items() if waiting_class == priority)


def notify_freed(resource: Hashable) -> None:
    """A capped endpoint's slot freed (called wherever a reservation is released)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    queue = _queues.get(loop)
    if queue is not None and queue.busy(resource):
        queue.notify(resource)
