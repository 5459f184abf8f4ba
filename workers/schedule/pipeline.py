"""One chat request through the cluster: the context phase, then the generation stream.

    async with ChatRun(chat, pool=pool, request_id=rid, tenant=key_name) as run:
        await run.stream_ready(slow_after=1.0, on_slow=start_keepalives)  # raises its WorkerError
        await run.relay(sink)                # each chunk to sink, as the worker's bytes arrive
    run.progress                             # stage, endpoints, timings (for the audit)

`ChatRun` owns every task, worker request and reservation it creates, and its exit releases them
exactly once whichever way the request ends: success, a worker failure, the client leaving
(cancellation), or a server shutdown. What goes to the workers is the pool's protocol's business
(`workers.protocols`); the run only orders the calls. The schedules, per pool:

- context first: reserve generation, send the context request, then the generation request
  carrying the handoff, and stream it;
- generation first: the generation request goes out first and waits on its worker for the KV of
  the pairing id; the context request follows; a context failure cancels the generation request;
- aggregated, or conditional: the pool's schedule is `aggregated`, or the prompt's uncached
  tokens are within `max_local_prefill_tokens` and the request skips the context phase; it goes
  whole to the reserved generation endpoint. TensorRT-LLM's rule (`_check_conditional_disagg`):
  the context phase is needed when `match_length == 0 or prompt_tokens - match_length >
  max_local_prefill_tokens`, `match_length` being how much of the prompt the chosen generation
  endpoint is expected to hold (`cache_aware` pools). Other pools know no match and compare the
  whole prompt, without the `match_length == 0` clause: a short prompt skips as before.

A client that leaves after the context worker issued its handoff must not strand the KV blocks
that handoff holds: a context worker keeps them until a generation worker takes them or its own
timeout expires (minutes: one common KV connector waits 480 s by default). So the generation
request is still dispatched, and closed as soon as its worker has taken the handoff, in a
detached task bounded by `WORKER_HANDOFF_RELEASE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from types import TracebackType
from typing import Any

from django.conf import settings
from xxhash import xxh3_64_intdigest

from workers.wire import client

from workers import protocols

from workers.admission import Priority, Ticket
from workers.admission.queue import get_queue
from workers.routing import router
from workers.wire.chat_stream import ChunkStream, Gather
from workers.schedule.completion import Completion
from workers.exceptions import StopRelay, WorkerError, WorkerUnreachable
from workers.cluster.health import FailureScope, failure_scope, health
from workers.cluster.metrics import worker_retries
from workers.models import CacheScope, Outcome, Role, RoutingPolicy, ScheduleStyle, Stage
from workers.routing.prefix_index import get_index
from workers.schedule.prompt_tokens import estimate_prompt_tokens
from workers.protocols import Call, ContextPeer, Handoff, WorkerProtocol
from workers.cluster.registry import EndpointInfo, PoolInfo
from workers.schedule.rendered_chat import RenderedChat
from workers.routing.reservations import Reservation
from workers.routing.router import Placement
from workers.schedule.progress import RunProgress

logger = logging.getLogger(__name__)

# Cleanups (closing a run, releasing a handoff) still running after their request ended, kept so
# they are not collected.
_detached: set[asyncio.Task[None]] = set()


class ChatRun:
    # The pool's protocol, resolved when the pipeline starts (a misconfigured pool fails there).
    _protocol: WorkerProtocol

    def __init__(
        self,
        chat: dict[str, Any],
        *,
        pool: PoolInfo,
        request_id: str,
        session: str | None = None,
        tenant: str | None = None,
        priority: Priority = Priority.STANDARD,
        size: int = 0,
        cache_salt: str | None = None,
        rendered: RenderedChat | None = None,
    ) -> None:
        """`session` keeps a conversation on one generation endpoint (session affinity);
        `tenant` names the API key, so a worker failure that may follow this client's request
        content counts against the endpoint only with other keys' (see `workers.cluster.health`).
        `tenant`, `session` and `priority` also order the admission queue when the pool is at
        capacity (`workers.admission`); `size` is the request's bytes, for the queue's bound.
        `cache_salt` names the tenant's prefix cache (the key's, or its cache group's): a pool
        whose `cache_scope` keeps keys apart salts the engines' caches and its prefix index with
        it, and relays no cache hit its engine cannot keep apart (`_hide_cached_tokens`).
        None in such a pool is a tenant of its own: the unsalted cache, which no salted request
        reads. `rendered` is `chat` already rendered (`RenderedChat.prepared`, e.g. off the event
        loop for a large request)."""
        self.chat = chat
        self.pool = pool
        self.request_id = request_id
        self.session = session
        self.tenant = tenant
        self.priority = priority
        self._size = size
        isolated = pool.cache_scope != CacheScope.SHARED
        salt = cache_salt if isolated else None
        self._call = Call(request_id=request_id, conversation_id=session, signing_key=pool.signing_key, cache_salt=salt)
        # The prompt's tenant in the prefix index (0: the cache every key shares).
        self._index_salt = xxh3_64_intdigest(salt.encode()) if salt else 0
        # The pool keeps keys apart but its engine has no salt: the worker's cached-token count
        # may be another key's hit, so none is relayed (resolved with the protocol).
        self._hide_cache_hits = isolated
        # Released once every worker request is sent: a Claude Code prompt is 80-190 KB of JSON,
        # and a stream may last minutes after that.
        self._rendered: RenderedChat | None = rendered if rendered is not None else RenderedChat(chat)
        self._progress = RunProgress(stage=Stage.RECEIVED)
        self._generation_url = ""

        self._reservations: list[Reservation] = []
        self._pipeline_started = False
        # Set by the generation request's own last step, when it runs as a task of its own (a
        # handoff pending): its waiter wakes a loop turn sooner than by awaiting the task
        # (workers/schedule/completion.py).
        self._generation_open: asyncio.Task[ChunkStream] | None = None
        self._generation_opened: Completion[ChunkStream] = Completion()
        self._stream: ChunkStream | None = None
        self._complete_response: dict[str, Any] | None = None
        self._handoff_issued = False
        self._generation_endpoint_id = 0
        self._placement: Placement | None = None
        # Whether the generation worker's reported cached tokens were compared with the index.
        self._cache_checked = False
        self._first_chunk = True  # no generation chunk has arrived yet
        self._closing: asyncio.Task[None] | None = None

    @property
    def rendered(self) -> RenderedChat:
        """The prompt serialized once, for the prefix index, the estimate and every worker body;
        until every worker request is sent."""
        if self._rendered is None:
            raise RuntimeError("the worker requests were sent: the rendered prompt is released")
        return self._rendered

    @functools.cached_property
    def estimated_prompt_tokens(self) -> int:
        """The prompt's token count as estimated before any worker tokenized it (computed once:
        conditional disaggregation and the front door's message_start both use it)."""
        rendered = self._rendered
        return rendered.estimated_prompt_tokens() if rendered is not None else estimate_prompt_tokens(self.chat)

    @property
    def progress(self) -> RunProgress:
        """Where the request is, what it touched, and when (an immutable snapshot)."""
        return self._progress

    def _note(self, **changes: Any) -> None:
        self._progress = replace(self._progress, **changes)

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> ChatRun:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            outcome = Outcome.SUCCESS
        elif issubclass(exc_type, asyncio.CancelledError):
            outcome = Outcome.CANCELLED
        else:
            outcome = Outcome.FAILURE
        await self.close(outcome)

    async def stream_ready(self, *, slow_after: float | None = None, on_slow: Callable[[], None] | None = None) -> None:
        """Run the pipeline up to a generation stream ready to read; raises its WorkerError.
        `on_slow` is called once, from the event loop, if the pipeline is still running
        `slow_after` seconds from now (a long context phase: a streamed answer starts meanwhile).

        The pipeline runs in the caller's task, not a child's: every task between a request and
        its worker's answer costs the start one more loop turn, and under a burst each turn is a
        pass over all the ready work (bench/loop_turns.py). Cancelling the caller cancels the
        pipeline where it is; the run's exit (`close()`) then decides what becomes of a
        generation request that carries a handoff."""
        if self._pipeline_started or self._closing is not None:
            raise RuntimeError("a run's pipeline runs once, before the run is closed")
        self._pipeline_started = True
        timer = None
        if on_slow is not None and slow_after is not None:
            timer = asyncio.get_running_loop().call_later(max(0.0, slow_after), on_slow)
        try:
            await self._open()
        finally:
            if timer is not None:
                timer.cancel()

    async def close(self, outcome: str) -> None:
        """Cancel what is still running and release every reservation; idempotent.

        The cleanup runs as a task of its own, shielded: a caller cancelled again while it waits
        (the server's application-close timeout or a shutdown, arriving while a loaded machine
        is slow to finish the first cancellation) returns at once, but cannot stop the cleanup
        halfway, which would leave a worker generating for a client that has left and its
        reservation held. The first outcome given is the one recorded."""
        if self._closing is None:
            self._closing = _detach(self._close(outcome), name=f"chat-run-close-{self.request_id}")
        await asyncio.shield(self._closing)

    async def _close(self, outcome: str) -> None:
        generation_open = self._generation_open
        if generation_open is not None:
            self._generation_open = None
            if self._stream is None and self._handoff_issued and not generation_open.done():
                self._release_handoff_later(generation_open)
            elif self._stream is None:
                await _close_when_taken(generation_open, timeout=0)
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()
        for reservation in self._reservations:
            # The phases release what they are done with; a second release would be counted as
            # a duplicate (gateway_duplicate_releases_total), which must mean a bug.
            if reservation.released_at is None:
                reservation.release(outcome)

    # --- the pipeline ----------------------------------------------------------------------------

    async def _open(self) -> None:
        try:
            await self._send_requests()
        finally:
            self._rendered = None

    async def _send_requests(self) -> None:
        pool = self.pool
        protocol = self._protocol = _protocol_for(pool)
        self._hide_cache_hits = self._hide_cache_hits and protocol.cache_salt_field is None
        started = time.monotonic()
        placement = self._placement = await router.place_generation(
            pool, self.request_id, self.rendered, session=self.session, ticket=self.ticket, tokens=self.tokens_in_flight,
            cache_salt=self._index_salt,
        )
        self._queued(started)
        generation = placement.reservation
        self._reservations.append(generation)
        self._generation_url = generation.endpoint.url
        self._note(generation_endpoint=generation.endpoint.url)
        self._generation_endpoint_id = generation.endpoint.id
        if pool.schedule_style == ScheduleStyle.AGGREGATED or self._prefill_locally(placement):
            await self._open_generation(protocol.aggregated_request(self.chat, self._call))
            return
        # Pairs the two legs of the request on the workers (the protocol puts it where its
        # engine expects it): random, so that gateway processes need not coordinate.
        pair_id = random.getrandbits(62)
        if pool.schedule_style == ScheduleStyle.GENERATION_FIRST:
            await self._generation_first(pair_id)
        else:
            await self._context_first(pair_id)

    def _prefill_locally(self, placement: Placement) -> bool:
        """Conditional disaggregation: whether the generation endpoint prefills this prompt
        itself (few uncached tokens) instead of taking a context worker's KV."""
        limit = self.pool.max_local_prefill_tokens
        if not limit:
            return False
        prompt_tokens = self.estimated_prompt_tokens
        if self.pool.routing != RoutingPolicy.CACHE_AWARE:
            return prompt_tokens <= limit
        match_length = placement.match_length(prompt_tokens)
        return match_length > 0 and prompt_tokens - match_length <= limit

    async def _context_first(self, pair_id: int) -> None:
        handoff = await self._context_phase(pair_id)
        complete = handoff.complete_answer
        if complete is not None:
            self._complete_response = complete
            self._release_stage(Role.GENERATION, Outcome.SUCCESS)
            return
        body = self._protocol.generation_request_after_context(self.chat, self._call, handoff)
        await self._open_generation(body)

    async def _generation_first(self, pair_id: int) -> None:
        context = await self._reserve(Role.CONTEXT)
        self._note(context_endpoint=context.endpoint.url)
        self._note(stage=Stage.CONTEXT)
        try:
            peer = await self._protocol.describe_context_peer(_peer(context.endpoint))
        except BaseException as exc:
            if isinstance(exc, WorkerError):
                self._report(context.endpoint.id, exc)
            context.release(Outcome.CANCELLED if isinstance(exc, asyncio.CancelledError) else Outcome.FAILURE)
            raise
        body = self._protocol.generation_request_first(
            self.chat, self._call, pair_id=pair_id, context=peer, schedule_style=ScheduleStyle.GENERATION_FIRST
        )
        generation_open = self._start_generation(body, waits_for_context=True)
        context_phase = asyncio.create_task(self._context_phase(pair_id, reservation=context, peer=peer))
        try:
            await asyncio.wait({context_phase, generation_open}, return_when=asyncio.FIRST_COMPLETED)
            if not context_phase.done() and not generation_open.cancelled() and generation_open.exception():
                # The generation side failed first (its worker is gone): stop the prefill now
                # rather than when it ends, possibly minutes later.
                context_phase.cancel()
                await asyncio.wait({context_phase})
                await self._await_generation()  # raises the generation failure
            await context_phase
        except BaseException:
            context_phase.cancel()
            # The paired generation request waits for KV that will never come: cancel it.
            if not self._handoff_issued:
                generation_open.cancel()
            await asyncio.wait({context_phase})  # its reservation is released before we go on
            raise
        self._note(stage=Stage.GENERATION)
        await self._await_generation()

    async def _context_phase(
        self, pair_id: int, reservation: Reservation | None = None, peer: ContextPeer | None = None
    ) -> Handoff:
        """Send the context request; a connection failure before any answer is retried once
        on another context endpoint."""
        self._note(stage=Stage.CONTEXT)
        protocol = self._protocol
        tried: list[str] = []
        # Generation-first already told its generation worker where the KV comes from.
        may_retry = reservation is None
        while True:
            if reservation is None:
                reservation = await self._reserve(Role.CONTEXT, exclude=tried)
            url = reservation.endpoint.url
            self._note(context_endpoint=url)
            body = protocol.context_request(
                self.chat,
                self._call,
                pair_id=pair_id,
                schedule_style=self.pool.schedule_style,
                context=peer if peer is not None else _peer(reservation.endpoint),
            )
            try:
                response = await client.post_completion(
                    url + protocol.chat_path,
                    self.rendered.dumps(body),
                    stage=Stage.CONTEXT,
                    headers=self._headers(body),
                    wordings=protocols.error_wordings(),
                    relayed_ints=protocol.relayed_ints_field,
                )
            except WorkerError as exc:
                self._report(reservation.endpoint.id, exc)
                reservation.release(Outcome.FAILURE)
                if not isinstance(exc, WorkerUnreachable):
                    raise
                tried.append(url)
                reservation = None
                if not may_retry or len(tried) > 1 or not self._has_other(Role.CONTEXT, tried):
                    raise
                worker_retries.labels(Stage.CONTEXT).inc()
                continue
            except BaseException as exc:
                reservation.release(Outcome.CANCELLED if isinstance(exc, asyncio.CancelledError) else Outcome.FAILURE)
                raise
            self._report(reservation.endpoint.id, None)
            handoff = protocol.read_context_answer(response)
            self._prefix_held(reservation.endpoint.id)
            reservation.release(Outcome.SUCCESS)
            self._handoff_issued = handoff.generation_pending
            self._note(context_done_at=time.monotonic())
            return handoff

    async def _open_generation(self, body: dict[str, Any]) -> None:
        self._note(stage=Stage.GENERATION)
        if self._handoff_issued:
            # The request carries a handoff: as a task of its own, so that close() can let its
            # worker take the KV even if this run is cancelled meanwhile.
            self._start_generation(body)
            await self._await_generation()
            return
        # Nothing to release on a cancellation but the request itself: sent from this task, a
        # loop turn sooner than through a child task.
        await self._await_generation(self._stream_from_generation(body, self.rendered.dumps(body)))

    def _start_generation(self, body: dict[str, Any], *, waits_for_context: bool = False) -> asyncio.Task[ChunkStream]:
        """Send the generation request as a task of its own (close() decides its fate)."""
        task = self._generation_opened.start(
            self._stream_from_generation(body, self.rendered.dumps(body), waits_for_context=waits_for_context)
        )
        self._generation_open = task
        return task

    async def _stream_from_generation(self, body: dict[str, Any], payload: bytes, *, waits_for_context: bool = False) -> ChunkStream:
        """`payload`: `body` serialized (by the caller, while the rendered prompt is held)."""
        url = self._generation_url + self._protocol.chat_path
        try:
            return await client.open_stream(
                url,
                payload,
                stage=Stage.GENERATION,
                headers=self._headers(body),
                waits_for_context=waits_for_context,
                wordings=protocols.error_wordings(),
            )
        except WorkerError as exc:
            explained = self._protocol.explain_error(exc, self._call)
            if explained is exc:
                raise
            raise explained from exc

    async def _await_generation(self, opening: Coroutine[Any, Any, ChunkStream] | None = None) -> None:
        """The generation stream, from `opening` or else from the generation request's task."""
        try:
            if opening is not None:
                self._stream = await opening
                return
            assert self._generation_open is not None
            # Through the Completion, which a cancellation reaching us here does not pass on: the
            # decision (cancel, or let the worker take the handoff first) stays with close().
            self._stream = await self._generation_opened.wait_result()
        except WorkerError as exc:
            # Only failures: the open stream's success is known when it has been read to its end.
            self._report(self._generation_endpoint_id, exc)
            raise

    # --- the stream ------------------------------------------------------------------------------

    async def relay(self, sink: Callable[[dict[str, Any]], None], gather: Gather | None = None) -> None:
        """The generation stream's chunks, after `stream_ready()`: `sink` gets each as the
        worker's bytes arrive, in the connection's receive callback (`ChunkStream.pump`), so it
        must not wait (`pause_relay` holds the worker back); the chunks of a read that brought
        several come between `gather.hold()` and `gather.release()`, if given. What `sink` raises ends the stream
        and is raised here, but `StopRelay`: the sink has taken all it will (the front door's
        output limit), and the answer ends there as complete; the worker's request is cancelled
        at once (its connection closed, the rest of its answer unread)."""
        if self._complete_response is not None:  # answered by the context phase: no stream
            self._note(first_chunk_at=time.monotonic())
            if gather is not None:
                gather.hold()
            try:
                for chunk in completion_as_chunks(self._complete_response):
                    if self._hide_cache_hits:
                        _hide_cached_tokens(chunk)
                    sink(chunk)
            except StopRelay:
                pass
            finally:
                if gather is not None:
                    gather.release()
            self._note(stage=Stage.DONE)
            return
        stream = self._stream
        assert stream is not None, "relay() before stream_ready()"
        seen = self._seen

        hide = self._hide_cache_hits

        def on_chunk(chunk: dict[str, Any]) -> None:
            seen(chunk)  # first: the index checks what the worker really reported
            if hide:
                _hide_cached_tokens(chunk)
            sink(chunk)

        try:
            await stream.pump(on_chunk, gather)
        except WorkerError as exc:
            self._generation_ended(exc)
            raise
        except StopRelay:
            # Not drained (the pump drains only after [DONE]): closing it closes the connection.
            await stream.aclose()
            self._stream = None
        self._generation_ended(None)

    def pause_relay(self) -> None:
        """Read no more of the generation stream until `resume_relay`: backpressure from a client
        slower than its worker (its idle deadline does not run meanwhile)."""
        if self._stream is not None:
            self._stream.pause()

    def resume_relay(self) -> None:
        if self._stream is not None:
            self._stream.resume()

    def _generation_ended(self, error: WorkerError | None) -> None:
        self._report(self._generation_endpoint_id, error)
        if error is None:
            self._note(stage=Stage.DONE)

    def _seen(self, chunk: dict[str, Any]) -> None:
        """A generation chunk arrived: the first one says the endpoint holds the prompt's
        prefix; the first usage says whether it still had what the index expected."""
        if self._first_chunk:
            self._first_chunk = False
            self._note(first_chunk_at=time.monotonic())
            self._prefix_held(self._generation_endpoint_id)
        if not self._cache_checked and "usage" in chunk:
            self._check_cached_tokens(chunk["usage"])

    # --- helpers -----------------------------------------------------------------------------------

    def _report(self, endpoint_id: int, error: WorkerError | None) -> None:
        """An endpoint's outcome for this request, to its breaker (which decides what counts)."""
        health.report(endpoint_id, error, tenant=self.tenant)
        if error is not None and failure_scope(error) is FailureScope.ENDPOINT:
            # The worker itself failed (gone, reset, timed out): it may come back with an empty
            # prefix cache, so what the index says it holds is forgotten.
            get_index().forget(endpoint_id)

    def _prefix_held(self, endpoint_id: int) -> None:
        """The endpoint answered (a context answer, or the generation's first token): it holds
        the prompt's prefix now."""
        placement = self._placement
        if placement is not None and placement.key is not None:
            get_index().confirm(endpoint_id, placement.key)

    def _check_cached_tokens(self, usage: Any) -> None:
        """A worker that reports no cached tokens for a prompt the index expected it to hold
        has lost its cache (a restart the health probe missed): start its index over."""
        self._cache_checked = True
        placement = self._placement
        if placement is None or placement.key is None or not placement.matched_bytes:
            return
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached == 0:
            index = get_index()
            index.forget(self._generation_endpoint_id)
            index.record(self._generation_endpoint_id, self.pool.name, placement.key)
            index.confirm(self._generation_endpoint_id, placement.key)

    def _headers(self, body: dict[str, Any]) -> dict[str, str]:
        return dict(self._protocol.headers(body, self._call))

    async def _reserve(self, role: str, exclude: list[str] | tuple[str, ...] = ()) -> Reservation:
        started = time.monotonic()
        reservation = await router.reserve(
            self.pool, role, self.request_id, session=self.session, exclude=exclude, placement=self._placement,
            ticket=self.ticket, tokens=self.tokens_in_flight,
        )
        self._queued(started)
        self._reservations.append(reservation)
        return reservation

    @functools.cached_property
    def ticket(self) -> Ticket:
        """Who this run is, for the admission queue's order (prompt tokens, charged when admitted)."""
        return Ticket(
            flow=self.tenant or "", session=self.session or "", priority=self.priority,
            tokens=self.estimated_prompt_tokens, size=self._size,
        )

    @functools.cached_property
    def tokens_in_flight(self) -> int:
        """What the run holds of a capped endpoint's `capacity_tokens`: prompt + max_tokens."""
        chat = self.chat
        output = chat.get("max_completion_tokens") or chat.get("max_tokens") or 0
        return self.estimated_prompt_tokens + (output if isinstance(output, int) else 0)

    def charge_output(self, tokens: int) -> None:
        """Count the answer's tokens toward this run's share of the admission queue (known only
        once it ends)."""
        if tokens > 0 and any(r.endpoint.capped for r in self._reservations):
            get_queue().charge(self.ticket, tokens)

    def _queued(self, started: float) -> None:
        waited = time.monotonic() - started
        if waited > 0.001:
            self._note(queued_s=self._progress.queued_s + waited)

    def _release_stage(self, role: str, outcome: str) -> None:
        for reservation in self._reservations:
            if reservation.stage == role and reservation.released_at is None:
                reservation.release(outcome)

    def _has_other(self, role: str, tried: list[str]) -> bool:
        return bool(router.candidates(self.pool, role, exclude=tried))

    def _release_handoff_later(self, generation_open: asyncio.Task[ChunkStream]) -> None:
        _detach(_close_when_taken(generation_open, settings.WORKER_HANDOFF_RELEASE_TIMEOUT_S))


def _hide_cached_tokens(chunk: dict[str, Any]) -> None:
    """Report no prompt token as read from the worker's cache: in a pool that keeps keys apart on
    an engine without a cache salt, the hit may have been earned by another key's prompt."""
    usage = chunk.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and details.get("cached_tokens"):
        details["cached_tokens"] = 0


def _detach(cleanup: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
    """Run a cleanup as a task that outlives whoever started it (held here until it ends: the
    loop keeps only weak references to tasks)."""
    task = asyncio.get_running_loop().create_task(cleanup, name=name)
    _detached.add(task)
    task.add_done_callback(_detached.discard)
    return task


def _peer(endpoint: EndpointInfo) -> ContextPeer:
    return ContextPeer(url=endpoint.url, options=endpoint.options)


def _protocol_for(pool: PoolInfo) -> WorkerProtocol:
    """The pool's protocol; a pool the system check would refuse fails its requests instead."""
    problem = protocols.misconfiguration(pool.protocol, pool.schedule_style, pool.max_local_prefill_tokens)
    protocol = protocols.lookup(pool.protocol)
    if problem is not None or protocol is None:
        logger.error("pool %s cannot serve requests: %s", pool.name, problem)
        raise WorkerError(500, "the worker pool for this model is misconfigured", stage=Stage.RECEIVED, code="misconfigured")
    return protocol


async def _close_when_taken(generation_open: asyncio.Task[ChunkStream], timeout: float) -> None:
    """Give a generation request up to `timeout` to be answered (its worker has then taken any
    handoff), cancel it otherwise, and close whatever stream it opened."""
    try:
        if not generation_open.done():
            await asyncio.wait({generation_open}, timeout=timeout)
        if not generation_open.done():
            generation_open.cancel()
            await asyncio.wait({generation_open})
        if not generation_open.cancelled() and generation_open.exception() is None:
            await generation_open.result().aclose()
    except Exception:  # a cleanup must never raise into the loop
        logger.exception("closing a generation request failed")


def completion_as_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streamed chat completion as the stream chunks that would have carried it."""
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    delta: dict[str, Any] = {"role": "assistant"}
    for key in ("content", "reasoning_content", "tool_calls"):
        if message.get(key):
            delta[key] = message[key]
    if "tool_calls" in delta:
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
    base = {"id": response.get("id", ""), "object": "chat.completion.chunk", "model": response.get("model", "")}
    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason") or "stop", **({"stop_reason": choice["stop_reason"]} if choice.get("stop_reason") is not None else {})}]},
    ]
    if response.get("usage"):
        chunks.append({**base, "choices": [], "usage": response["usage"]})
    return chunks


__all__ = ["ChatRun", "RunProgress", "WorkerError", "completion_as_chunks"]
