"""The orders of a request's worker calls, keyed by its pool's `ScheduleStyle` (`SCHEDULES`):

- context first: the context request, then the generation request carrying the handoff that
  the context worker answered with, streamed;
- generation first: the generation request goes out first and waits on its worker for the KV of
  the pairing id; the context request follows; a context failure cancels the generation request;
- aggregated, or conditional: the pool's schedule is `aggregated`, or the prompt's uncached
  tokens are within `max_local_prefill_tokens` and the request skips the context phase; it goes
  whole to the reserved generation endpoint. TensorRT-LLM's rule (`_check_conditional_disagg`):
  the context phase is needed when `match_length == 0 or prompt_tokens - match_length >
  max_local_prefill_tokens`, `match_length` being how much of the prompt the chosen generation
  endpoint is expected to hold (`cache_aware` pools). Other pools know no match and compare the
  whole prompt, without the `match_length == 0` clause: a short prompt skips as before.

Every schedule starts with the generation endpoint reserved (the router picks it first) and
decides only the order. What each request says is the pool's protocol's (`workers.protocols`);
reserving, opening the generation stream, recording progress and releasing whatever is left when
the request ends are the run's (`Steps`, which `ChatRun` implements).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from workers import protocols
from workers.cluster.metrics import worker_retries
from workers.cluster.registry import EndpointInfo, PoolInfo
from workers.exceptions import WorkerError, WorkerUnreachable
from workers.models import Outcome, Role, RoutingPolicy, ScheduleStyle, Stage
from workers.protocols import Call, ContextPeer, Handoff, WorkerProtocol
from workers.routing import fallback, router
from workers.routing.reservations import Reservation
from workers.routing.router import Placement
from workers.schedule.cache_feedback import CacheFeedback
from workers.schedule.rendered_chat import RenderedChat
from workers.wire import client
from workers.wire.chat_stream import ChunkStream

logger = logging.getLogger(__name__)


class Steps(Protocol):
    """What a schedule asks of its run (`workers.schedule.pipeline.ChatRun`)."""

    chat: dict[str, Any]
    pool: PoolInfo
    #: The pool's engine dialect: it builds every worker request and reads the context answer.
    protocol: WorkerProtocol
    #: What the protocol may need beyond the chat body.
    call: Call
    #: Told when an endpoint answers (it holds the prompt's prefix then).
    feedback: CacheFeedback
    #: The context worker issued a handoff a generation worker must take: the run's exit then
    #: lets the generation request's worker take it, whatever happened to the client.
    handoff_issued: bool
    #: The generation endpoint's KV-cache events are followed: the prompt's token ids, where a
    #: worker answers with them, are learned for the next turn (`CacheFeedback.on_prompt_tokens`).
    learns_prompt_tokens: bool

    @property
    def rendered(self) -> RenderedChat:
        """The prompt serialized once, for every worker body."""

    @property
    def estimated_prompt_tokens(self) -> int:
        """The prompt's tokens as estimated before any worker counted them."""

    def note(self, **changes: Any) -> None:
        """Record where the request is (`RunProgress` fields)."""

    async def reserve(self, role: Role, exclude: Sequence[str] = ()) -> Reservation:
        """An endpoint of `role` but `exclude` (URLs), once admitted; the run releases it at its
        exit if the schedule has not."""

    def report(self, endpoint_id: int, error: WorkerError | None) -> None:
        """An endpoint's outcome for this request, to its breaker and the prefix index."""

    def answered_in_full(self, response: dict[str, Any]) -> None:
        """The context worker's answer is the whole answer: no generation request follows."""

    async def open_generation(self, body: dict[str, Any]) -> None:
        """Send the generation request and wait for its stream; raises its failure. With a
        handoff issued it goes as a task of its own, so that the run's exit can let its worker
        take the KV whatever happens to the client."""

    def start_generation(self, body: dict[str, Any], *, waits_for_context: bool = False) -> asyncio.Task[ChunkStream]:
        """Send the generation request as a task of its own, now (`await_generation` waits)."""

    async def await_generation(self) -> None:
        """Wait for the started generation request's stream; raises its failure."""


Schedule = Callable[[Steps], Awaitable[None]]


def schedule_for(run: Steps, placement: Placement) -> Schedule:
    """The request's schedule: its pool's, or aggregated if its generation endpoint prefills the
    prompt itself (conditional disaggregation)."""
    style = run.pool.schedule_style
    if style == ScheduleStyle.AGGREGATED or _prefills_locally(run, placement):
        return aggregated
    return SCHEDULES[style]


async def aggregated(run: Steps) -> None:
    await run.open_generation(run.protocol.aggregated_request(run.chat, run.call))


async def context_first(run: Steps) -> None:
    handoff = await context_phase(run, _pair_id())
    complete = handoff.complete_answer
    if complete is not None:
        run.answered_in_full(complete)
        return
    await run.open_generation(run.protocol.generation_request_after_context(run.chat, run.call, handoff))


async def generation_first(run: Steps) -> None:
    pair_id = _pair_id()
    context = await run.reserve(Role.CONTEXT)
    run.note(context_endpoint=context.endpoint.url, stage=Stage.CONTEXT)
    try:
        peer = await run.protocol.describe_context_peer(_peer(context.endpoint))
    except BaseException as exc:
        if isinstance(exc, WorkerError):
            run.report(context.endpoint.id, exc)
        context.release(Outcome.CANCELLED if isinstance(exc, asyncio.CancelledError) else Outcome.FAILURE)
        raise
    body = run.protocol.generation_request_first(
        run.chat, run.call, pair_id=pair_id, context=peer, schedule_style=ScheduleStyle.GENERATION_FIRST
    )
    generation_open = run.start_generation(body, waits_for_context=True)
    context_done = asyncio.create_task(context_phase(run, pair_id, reservation=context, peer=peer))
    try:
        await asyncio.wait({context_done, generation_open}, return_when=asyncio.FIRST_COMPLETED)
        if not context_done.done() and not generation_open.cancelled() and generation_open.exception():
            # The generation side failed first (its worker is gone): stop the prefill now
            # rather than when it ends, possibly minutes later.
            context_done.cancel()
            await asyncio.wait({context_done})
            await run.await_generation()  # raises the generation failure
        await context_done
    except BaseException:
        context_done.cancel()
        # The paired generation request waits for KV that will never come: cancel it.
        if not run.handoff_issued:
            generation_open.cancel()
        await asyncio.wait({context_done})  # its reservation is released before we go on
        raise
    run.note(stage=Stage.GENERATION)
    await run.await_generation()


SCHEDULES: dict[str, Schedule] = {
    ScheduleStyle.CONTEXT_FIRST: context_first,
    ScheduleStyle.GENERATION_FIRST: generation_first,
    ScheduleStyle.AGGREGATED: aggregated,
}


async def context_phase(
    run: Steps, pair_id: int, reservation: Reservation | None = None, peer: ContextPeer | None = None
) -> Handoff:
    """Send the context request; a connection failure before any answer is retried once on
    another context endpoint (not when generation-first already told its generation worker
    where the KV comes from: `reservation` given)."""
    run.note(stage=Stage.CONTEXT)
    protocol = run.protocol
    tried: list[str] = []
    may_retry = reservation is None
    while True:
        if reservation is None:
            reservation = await run.reserve(Role.CONTEXT, exclude=tried)
        url = reservation.endpoint.url
        run.note(context_endpoint=url)
        body = protocol.context_request(
            run.chat,
            run.call,
            pair_id=pair_id,
            schedule_style=run.pool.schedule_style,
            context=peer if peer is not None else _peer(reservation.endpoint),
        )
        try:
            response = await client.post_completion(
                url + protocol.chat_path,
                run.rendered.dumps(body),
                stage=Stage.CONTEXT,
                headers=dict(protocol.headers(body, run.call)),
                wordings=protocols.error_wordings(),
                relayed_ints=protocol.relayed_ints_field,
            )
        except WorkerError as exc:
            run.report(reservation.endpoint.id, exc)
            reservation.release(Outcome.FAILURE)
            if not isinstance(exc, WorkerUnreachable):
                raise
            tried.append(url)
            reservation = None
            if not may_retry or len(tried) > 1 or not _retry_has_somewhere(run.pool, tried):
                raise
            worker_retries.labels(Stage.CONTEXT).inc()
            continue
        except BaseException as exc:
            reservation.release(Outcome.CANCELLED if isinstance(exc, asyncio.CancelledError) else Outcome.FAILURE)
            raise
        run.report(reservation.endpoint.id, None)
        handoff = protocol.read_context_answer(response)
        run.feedback.on_first_chunk(reservation.endpoint.id)
        if run.learns_prompt_tokens and (reader := handoff.prompt_ids_reader) is not None:
            run.feedback.on_prompt_tokens(reader)  # TensorRT-LLM's context answer carries them
        reservation.release(Outcome.SUCCESS)
        run.handoff_issued = handoff.generation_pending
        run.note(context_done_at=time.monotonic())
        return handoff


def protocol_for(pool: PoolInfo) -> WorkerProtocol:
    """The pool's protocol, which must run the pool's schedule; a pool the system check would
    refuse fails its requests instead."""
    problem = protocols.misconfiguration(pool.protocol, pool.schedule_style, pool.max_local_prefill_tokens)
    protocol = protocols.lookup(pool.protocol)
    if problem is not None or protocol is None:
        logger.error("pool %s cannot serve requests: %s", pool.name, problem)
        raise WorkerError(500, "the worker pool for this model is misconfigured", stage=Stage.RECEIVED, code="misconfigured")
    return protocol


def _prefills_locally(run: Steps, placement: Placement) -> bool:
    """Conditional disaggregation: whether the generation endpoint prefills this prompt itself
    (few uncached tokens) instead of taking a context worker's KV."""
    limit = run.pool.max_local_prefill_tokens
    if not limit:
        return False
    prompt_tokens = run.estimated_prompt_tokens
    if run.pool.routing != RoutingPolicy.CACHE_AWARE:
        return prompt_tokens <= limit
    match_length = placement.match_length(prompt_tokens)
    return match_length > 0 and prompt_tokens - match_length <= limit


def _retry_has_somewhere(pool: PoolInfo, tried: list[str]) -> bool:
    """Whether another context endpoint may take the retry: one usable, or, failing that, one
    the router would take despite its probes (`workers.routing.fallback`)."""
    return bool(router.candidates(pool, Role.CONTEXT, exclude=tried) or fallback.slow_only(pool, Role.CONTEXT, exclude=tried))


def _pair_id() -> int:
    """Pairs the two legs of a request on the workers (the protocol puts it where its engine
    expects it): random, so that gateway processes need not coordinate."""
    return random.getrandbits(62)


def _peer(endpoint: EndpointInfo) -> ContextPeer:
    return ContextPeer(url=endpoint.url, options=endpoint.options)


__all__ = [
    "aggregated",
    "context_first",
    "context_phase",
    "generation_first",
    "protocol_for",
    "Schedule",
    "schedule_for",
    "SCHEDULES",
    "Steps",
]
