"""The batch runner: one task per gateway process, started with the process's other background
services, that claims batch items and answers each as a `/v1/messages` request of the admission
queue's `batch` class, with the owning key's limits and budgets.

Claiming. It claims only while fewer than BATCH_QUEUE_TARGET batch requests of this process wait
in the admission queue and fewer than BATCH_MAX_IN_FLIGHT items run here: waiting items cost a
row, not a task, and the pool's free slots are taken by batch work the moment no interactive
request wants them (strict priority in the queue puts every interactive request ahead of every
waiting batch item: it waits at most for the items already running).

Leases. Each claimed item carries a lease, renewed every third of BATCH_LEASE_S for every item this
process holds (one statement). An item whose lease the database no longer shows as this claim's
(it expired, its batch expired, recovery gave it away) is cancelled here at once, and so is
every item when renewals have failed for most of a lease (the database away): a process never
runs an item past the time another may have claimed it. Leases of a process that died go back
to the queue through the recovery sweep (`workers.process_abandoned`, `release_abandoned`), and
any lease expired for BATCH_LEASE_S / 2 more through this runner's own sweep.

Outcomes. A succeeded item's Message, or a worker's or the validator's answer about the request
itself (4xx: a prompt too long, say) as `errored` with the full error envelope. A rate limit, a
full queue or an overloaded pool (429, 503, 529) is not the item's fault: it goes back to the
queue with a backoff and is tried again until its batch expires. Other server errors (500, 502,
504) are tried again up to BATCH_MAX_ATTEMPTS, then `errored`. Each attempt is an audit row of
its own (with the batch's id and the item's custom_id) and counts in the key's usage.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import orjson
from django.conf import settings

from disagg_project import GATEWAY_INSTANCE, tracing
from messages_api import metrics, request_span
from messages_api.answer import answer_message, end_failed
from messages_api.audit import AuditRecord
from messages_api.auth import key_cache
from messages_api.batches import store
from messages_api.batches.store import Claimed
from messages_api.errors import AnthropicError, AuthenticationFailed, DeadlineExceeded, client_error
from messages_api.models import RequestStatus, ResultType
from messages_api.revocation import KeyRevoked, open_requests
from messages_api.server.drain import is_draining
from workers import Priority, admission_waiting

__all__ = ["BatchRunner", "release_abandoned", "start", "wake"]

logger = logging.getLogger(__name__)

# Not the item's fault: tried again until the batch expires.
RETRY_ALWAYS = frozenset({429, 503, 529})
# After a full claim, the next waits this long (see `_claim_loop`).
CLAIM_AGAIN_S = 0.05
# A share of the lease after which, renewals having failed, the items held are given up.
GIVE_UP_SHARE = 0.8


@dataclass(eq=False)
class _Running:
    """An item this process runs: its claim, its task, and whether its key was revoked."""

    item: Claimed
    #: When its claim began (monotonic): the attempt's audit row counts as received then, so
    #: that an item claimed before a cancellation never reads as started after it.
    claimed_at: float
    task: asyncio.Task[None] | None = None
    revoked: bool = False

    def revoke(self) -> None:
        """Its key was revoked (messages_api/revocation.py): the item ends `errored` with 401."""
        if self.task is not None and not self.task.done() and not self.revoked:
            self.revoked = True
            self.task.cancel()


@dataclass
class BatchRunner:
    running: dict[int, _Running] = field(default_factory=dict)
    renewed_at: float = field(default_factory=time.monotonic)
    #: Keys (hashes) refused for their limits, until when (monotonic): their batches' items are
    #: not claimed meanwhile, so a key over its limits costs no attempts, rows or claims.
    paused: dict[str, float] = field(default_factory=dict)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        self._wakeup.set()

    async def run(self) -> None:
        """Claim, renew and sweep until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(_every(settings.BATCH_LEASE_S / 3, self.renew), name="batch-lease-renewal")
            group.create_task(_every(settings.BATCH_SWEEP_INTERVAL_S, self.sweep), name="batch-sweep")
            group.create_task(self._claim_loop(), name="batch-claims")

    # --- claims ---------------------------------------------------------------------------------

    def room(self) -> int:
        """How many items this process may claim now: none while it drains (SIGTERM; the items it
        runs go on, and recovery gives back those it is stopped with)."""
        if is_draining() or admission_waiting(Priority.BATCH) >= settings.BATCH_QUEUE_TARGET:
            return 0
        return min(settings.BATCH_MAX_IN_FLIGHT - len(self.running), settings.BATCH_CLAIM_SIZE)

    async def _claim_loop(self) -> None:
        while True:
            claimed: list[Claimed] = []
            room = self.room()
            claimed_at = now = time.monotonic()
            if room > 0:
                self.paused = {key: until for key, until in self.paused.items() if until > now}
                try:
                    claimed = await store.RUNNER_THREAD.run(
                        store.claim, GATEWAY_INSTANCE, room, settings.BATCH_LEASE_S, tuple(self.paused)
                    )
                except Exception:
                    logger.exception("could not claim batch items; retrying")
            for item in claimed:
                self.start(item, claimed_at)
            if claimed and len(claimed) == room:
                # There may be more: claim again once these have reached the admission queue (a
                # few milliseconds of intake), so that its count of waiting batch items is theirs.
                await asyncio.sleep(CLAIM_AGAIN_S)
                continue
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), settings.BATCH_POLL_INTERVAL_S)
            except TimeoutError:
                pass

    def start(self, item: Claimed, claimed_at: float) -> None:
        running = _Running(item, claimed_at)
        self.running[item.pk] = running
        running.task = asyncio.get_running_loop().create_task(self._run_item(running), name=f"batch-item-{item.pk}")

    # --- one item ---------------------------------------------------------------------------------

    async def _run_item(self, running: _Running) -> None:
        item = running.item
        record = AuditRecord(route="POST /v1/messages", batch_id=item.batch_id, custom_id=item.custom_id)
        record.received_earlier(time.monotonic() - running.claimed_at)
        # Traced, each attempt is a trace of its own, linked to the batch's creation.
        span = request_span.start_batch_item(record, item.attempt, item.batch_traceparent) if tracing.on else None
        try:
            await self._answer(running, record)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if running.revoked and task is not None:
                task.uncancel()
                await self._errored(running, record, KeyRevoked())
            elif record.begun:
                record.end(RequestStatus.CANCELLED, http_status=499)
            # A lost lease (another claim owns the item now) or this process stopping (recovery
            # gives the item back): nothing is written.
            if not running.revoked:
                raise
        except Exception:
            logger.exception("batch item %s/%s: the runner failed", item.batch_id, item.custom_id)
        finally:
            if span is not None:
                request_span.end(span, record)
            open_requests.discard(running)
            self.running.pop(item.pk, None)
            self._wakeup.set()

    async def _answer(self, running: _Running, record: AuditRecord) -> None:
        item = running.item
        principal = await key_cache.authenticate_hash(item.key_hash)
        if principal is None:
            await self._errored(running, record, AuthenticationFailed("The API key that created this batch is no longer active"))
            return
        record.api_key_name, record.api_key_id = principal.name, principal.key_id or None
        deadline_s = settings.MESSAGES_REQUEST_DEADLINE_S
        try:
            open_requests.add(principal.key_hash, running)  # revoking the key ends its items too
            deadline = asyncio.timeout(deadline_s if deadline_s > 0 else None)
            try:
                async with deadline:
                    message = await answer_message(item.params, principal, record, priority=Priority.BATCH)
            except TimeoutError as exc:
                if not deadline.expired():
                    raise
                raise DeadlineExceeded(deadline_s) from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not record.begun and client_error(exc).status == 429:
                # The key is over its limits: refused before it was accepted, as an HTTP client
                # flooding past them would be, its row sampled; its other items wait with it.
                error = end_failed(record, exc, sample_refusals=True)
                self.paused[principal.key_hash] = time.monotonic() + (error.retry_after or 1.0)
            else:
                error = end_failed(record, exc)
            if error.status in RETRY_ALWAYS or (error.status >= 500 and item.attempt < settings.BATCH_MAX_ATTEMPTS):
                await self._retry(running, record, error)
            else:
                await self._write(running, ResultType.ERRORED, _errored_result(error, record.request_id), record.request_id)
            return
        result = b'{"type":"succeeded","message":%s}' % orjson.dumps(message)
        await self._write(running, ResultType.SUCCEEDED, result.decode(), record.request_id)

    async def _errored(self, running: _Running, record: AuditRecord, error: AnthropicError) -> None:
        end_failed(record, error)
        await self._write(running, ResultType.ERRORED, _errored_result(error, record.request_id), record.request_id)

    async def _write(self, running: _Running, result_type: str, result: str, request_id: str) -> None:
        """The item's one result, if this claim still holds it. A write that fails (the database
        away) is tried again while the item is held (its lease renewed meanwhile): given up, the
        item would run again."""
        delay = 0.1
        while True:
            try:
                written = await asyncio.shield(
                    store.RUNNER_THREAD.run(store.finish, GATEWAY_INSTANCE, running.item, result_type, result, request_id)
                )
                break
            except Exception:
                logger.warning("batch item %s/%s: its result could not be written; trying again", running.item.batch_id,
                               running.item.custom_id, exc_info=True)  # fmt: skip
                await asyncio.sleep(delay)  # cancelled when the lease is lost
                delay = min(delay * 2, 5.0)
        if written:
            metrics.batch_items.labels(result_type).inc()

    async def _retry(self, running: _Running, record: AuditRecord, error: AnthropicError) -> None:
        item = running.item
        wait = backoff(item.attempt, error.retry_after)
        not_before = datetime.now(timezone.utc) + timedelta(seconds=wait)
        await asyncio.shield(store.RUNNER_THREAD.run(store.requeue, GATEWAY_INSTANCE, item, not_before, record.request_id))
        metrics.batch_retries.labels(error.error_type).inc()

    # --- leases and the sweep ---------------------------------------------------------------------

    async def renew(self) -> None:
        """Extend this process's leases; cancel the items it no longer holds."""
        held = {pk: running.item.attempt for pk, running in self.running.items()}
        if not held:
            self.renewed_at = time.monotonic()
            return
        try:
            kept = await store.RUNNER_THREAD.run(store.renew, GATEWAY_INSTANCE, held, settings.BATCH_LEASE_S)
        except Exception:
            if time.monotonic() - self.renewed_at > settings.BATCH_LEASE_S * GIVE_UP_SHARE:
                logger.error("batch leases not renewed for %.0f s: giving up the %d items held", time.monotonic() - self.renewed_at, len(held))
                self._lose(set(held))
            raise
        self.renewed_at = time.monotonic()
        self._lose(set(held) - kept)

    def _lose(self, pks: set[int]) -> None:
        for pk in pks:
            running = self.running.get(pk)
            if running is not None and running.task is not None and not running.task.done():
                running.task.cancel()

    async def sweep(self) -> None:
        swept = await store.RUNNER_THREAD.run(store.sweep, settings.BATCH_LEASE_S / 2)
        metrics.batch_items_waiting.set(swept.queued)
        metrics.batch_items_running.set(swept.running)
        if swept.expired:
            metrics.batch_items.labels(ResultType.EXPIRED).inc(swept.expired)
        if swept.released:
            logger.warning("%d batch item(s) whose lease expired went back to the queue", swept.released)


def _errored_result(error: AnthropicError, request_id: str) -> str:
    return orjson.dumps({"type": "errored", "error": error.body(request_id)}).decode()


def backoff(attempt: int, retry_after: float | None) -> float:
    """Seconds before an item refused for load is tried again: exponential in its attempts (from
    BATCH_RETRY_BASE_S, at most BATCH_RETRY_MAX_S), never sooner than the refusal's retry-after,
    with jitter so that the items refused together do not come back together."""
    exponential: float = min(settings.BATCH_RETRY_MAX_S, settings.BATCH_RETRY_BASE_S * 2 ** max(0, attempt - 1))
    return max(retry_after or 0.0, exponential * random.uniform(0.5, 1.0))


async def _every(interval: float, work: Callable[[], Awaitable[object]]) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch runner: %s failed; retrying", getattr(work, "__name__", work))


_runners: dict[asyncio.AbstractEventLoop, tuple[BatchRunner, asyncio.Task[None]]] = {}


def start() -> None:
    """Start this event loop's runner unless it runs already (BATCH_RUNNER_ENABLED)."""
    if not settings.BATCH_RUNNER_ENABLED:
        return
    loop = asyncio.get_running_loop()
    if loop in _runners:
        return
    for stale in [other for other in _runners if other.is_closed()]:
        del _runners[stale]
    runner = BatchRunner()
    _runners[loop] = (runner, loop.create_task(runner.run(), name="batch-runner"))


def wake() -> None:
    """A batch was created here: claim now rather than at the next poll."""
    try:
        entry = _runners.get(asyncio.get_running_loop())
    except RuntimeError:
        return
    if entry is not None:
        entry[0].wake()


def release_abandoned(sender: object, instances: list[str], reason: str, **kwargs: object) -> None:
    """`workers.process_abandoned` receiver: a dead process's items go back to the queue."""
    released = store.release_instances(instances)
    if released:
        logger.warning("%d batch item(s) of dead gateway process(es) went back to the queue", released)
