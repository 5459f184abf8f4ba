"""One chat request through the cluster: routing, the pool's schedule of worker requests, then the
generation stream.

    async with ChatRun(chat, pool=pool, request_id=rid, tenant=key_name) as run:
        await run.stream_ready(slow_after=1.0, on_slow=start_keepalives)  # raises its WorkerError
        await run.relay(sink)                # each chunk to sink, as the worker's bytes arrive
    run.progress                             # stage, endpoints, timings (for the audit)

`ChatRun` owns every task, worker request and reservation it creates, and its exit releases them
exactly once whichever way the request ends: success, a worker failure, the client leaving
(cancellation), or a server shutdown. Beside it: `schedules` (the order of a pool's worker calls),
`cache_feedback` (what the answers tell the prefix index) and `cleanup` (what outlives the
request: a generation request carrying a handoff is closed once its worker took the KV). What goes
to the workers is the protocol's (`workers.protocols`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

from xxhash import xxh3_64_intdigest

from disagg_project import tracing
from workers import protocols
from workers.admission import Priority, Ticket
from workers.admission.queue import get_queue
from workers.cluster.health import health
from workers.cluster.registry import PoolInfo
from workers.exceptions import StopRelay, WorkerError
from workers.kv_events.subscriber import kv_events
from workers.models import CacheScope, Outcome, Role, Stage
from workers.protocols import Call, WorkerProtocol
from workers.protocols.base import completion_as_chunks
from workers.routing import router
from workers.routing.reservations import Reservation
from workers.routing.router import Placement
from workers.schedule import schedules
from workers.schedule.cache_feedback import CacheFeedback, hide_cached_tokens
from workers.schedule.cleanup import close_when_taken, detach, release_handoff
from workers.schedule.completion import Completion
from workers.schedule.progress import RunProgress
from workers.schedule.prompt_tokens import estimate_prompt_tokens
from workers.schedule.rendered_chat import RenderedChat
from workers.wire import client
from workers.wire.chat_stream import ChunkStream, Gather


class ChatRun:
    """The front door uses `stream_ready`, `relay` (with `pause_relay`/`resume_relay`), the exit
    or `close`, `progress`, `estimated_prompt_tokens` and `charge_output`. The steps below them
    are the schedules' (`workers.schedule.schedules.Steps`)."""

    #: The pool's protocol, resolved when the pipeline starts (a misconfigured pool fails there).
    protocol: WorkerProtocol

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
        it, and relays no cache hit its engine cannot keep apart (`hide_cached_tokens`).
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
        self.call = Call(request_id=request_id, conversation_id=session, signing_key=pool.signing_key, cache_salt=salt)
        # The prompt's tenant in the prefix index (0: the cache every key shares).
        self._index_salt = xxh3_64_intdigest(salt.encode()) if salt else 0
        # The pool keeps keys apart but its engine has no salt: the worker's cached-token count
        # may be another key's hit, so none is relayed (resolved with the protocol).
        self._hide_cache_hits = isolated
        self.feedback = CacheFeedback(pool.name)
        # Released once every worker request is sent: a Claude Code prompt is 80-190 KB of JSON,
        # and a stream may last minutes after that.
        self._rendered: RenderedChat | None = rendered if rendered is not None else RenderedChat(chat)
        self._progress = RunProgress(stage=Stage.RECEIVED)
        self._reservations: list[Reservation] = []
        self._placement: Placement | None = None
        self._generation_url = ""
        self._generation_endpoint_id = 0
        self._pipeline_started = False
        self.handoff_issued = False
        # Set by the generation request's own last step, when it runs as a task of its own (a
        # handoff pending): its waiter wakes a loop turn sooner than by awaiting the task
        # (workers/schedule/completion.py).
        self._generation_open: asyncio.Task[ChunkStream] | None = None
        self._generation_opened: Completion[ChunkStream] = Completion()
        self._stream: ChunkStream | None = None
        self._complete_response: dict[str, Any] | None = None
        self._first_chunk = True  # no generation chunk has arrived yet
        #: The prompt's token ids (the first chunk's, or the context answer's) are for the KV-event join.
        self.learns_prompt_tokens = False
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

    async def stream_ready(
        self, *, slow_after: float | None = None, on_slow: Callable[[], None] | None = None,
        on_wait: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Run the pipeline up to a generation stream ready to read; raises its WorkerError.
        `on_slow` is called once, from the event loop, if the pipeline is still running
        `slow_after` seconds from now (a long context phase: a streamed answer starts meanwhile).
        `on_wait` is awaited, in the pipeline, when the request is about to wait in the admission
        queue (`on_slow` is not called after it; the caller makes the two one start): under a burst most requests wait, and each
        one's answer starts as it joins the queue, in its own step, rather than all together when
        their timers fall due, behind every other request's start (bench/burst.py).

        The pipeline runs in the caller's task, not a child's: every task between a request and
        its worker's answer costs the start one more loop turn, and under a burst each turn is a
        pass over all the ready work (bench/loop_turns.py). Cancelling the caller cancels the
        pipeline where it is; the run's exit (`close()`) then decides what becomes of a
        generation request that carries a handoff."""
        if self._pipeline_started or self._closing is not None:
            raise RuntimeError("a run's pipeline runs once, before the run is closed")
        self._pipeline_started = True
        timer: asyncio.TimerHandle | None = None
        if on_slow is not None and slow_after is not None:
            timer = asyncio.get_running_loop().call_later(max(0.0, slow_after), on_slow)
        if on_wait is not None:
            ticket = self.ticket

            async def waits() -> None:
                ticket.on_wait = None
                if timer is not None:
                    timer.cancel()
                await on_wait()

            ticket.on_wait = waits
        try:
            await self._open()
        finally:
            if timer is not None:
                timer.cancel()
            if on_wait is not None:
                self.ticket.on_wait = None

    async def close(self, outcome: Outcome) -> None:
        """Cancel what is still running and release every reservation; idempotent.

        The cleanup runs as a task of its own, shielded: a caller cancelled again while it waits
        (the server's application-close timeout or a shutdown, arriving while a loaded machine
        is slow to finish the first cancellation) returns at once, but cannot stop the cleanup
        halfway, which would leave a worker generating for a client that has left and its
        reservation held. The first outcome given is the one recorded."""
        if self._closing is None:
            self._closing = detach(self._close(outcome), name=f"chat-run-close-{self.request_id}")
        await asyncio.shield(self._closing)

    async def _close(self, outcome: Outcome) -> None:
        generation_open = self._generation_open
        if generation_open is not None:
            self._generation_open = None
            if self._stream is None and self.handoff_issued and not generation_open.done():
                release_handoff(generation_open)
            elif self._stream is None:
                await close_when_taken(generation_open, timeout=0)
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.end_span("" if outcome == Outcome.SUCCESS else str(outcome))  # not relayed to its end
            await stream.aclose()
        for reservation in self._reservations:
            # The phases release what they are done with; a second release would be counted as
            # a duplicate (gateway_duplicate_releases_total), which must mean a bug.
            if reservation.released_at is None:
                reservation.release(outcome)

    async def _open(self) -> None:
        """Route, then run the request's schedule (the rendered prompt is released after)."""
        pool = self.pool
        try:
            protocol = self.protocol = schedules.protocol_for(pool)
            self._hide_cache_hits = self._hide_cache_hits and protocol.cache_salt_field is None
            started = time.monotonic()
            placement = self._placement = await router.place_generation(
                pool, self.request_id, self.rendered, session=self.session, ticket=self.ticket,
                tokens=self.tokens_in_flight, cache_salt=self._index_salt,
            )
            self._queued(started)
            self.feedback.on_routed(placement)
            generation = placement.reservation
            if kv_events.view and generation.endpoint.id in kv_events.view and self.call.cache_salt is None:
                # Its engine's KV-cache events are followed: learn the prompt's token ids from its
                # answer (not for a salted prompt: its blocks' hashes carry the salt as the engine
                # words it, which is not reproduced here; the approximate index routes it).
                self.call = replace(self.call, return_token_ids=True)
                self.learns_prompt_tokens = True
            self._reservations.append(generation)
            self._generation_url = generation.endpoint.url
            self.note(generation_endpoint=generation.endpoint.url)
            self._generation_endpoint_id = generation.endpoint.id
            await schedules.schedule_for(self, placement)(self)
        finally:
            self._rendered = None

    # --- the stream ------------------------------------------------------------------------------

    async def relay(self, sink: Callable[[dict[str, Any]], None], gather: Gather | None = None) -> None:
        """The generation stream's chunks, after `stream_ready()`: `sink` gets each as the
        worker's bytes arrive, in the connection's receive callback (`ChunkStream.pump`), so it
        must not wait (`pause_relay` holds the worker back); the chunks of a read that brought
        several come between `gather.hold()` and `gather.release()`, if given. What `sink` raises
        ends the stream and is raised here, but `StopRelay`: the sink has taken all it will (the
        front door's output limit), and the answer ends there as complete; the worker's request
        is cancelled at once (its connection closed, the rest of its answer unread).

        Traced, the relay is a span of its own (`gateway.relay`), from here to the stream's end."""
        if not tracing.on:
            await self._relay(sink, gather)
            return
        span = tracing.child("gateway.relay")
        try:
            await self._relay(sink, gather)
        except BaseException as exc:
            tracing.end(span, exc)
            raise
        tracing.end(span)

    async def _relay(self, sink: Callable[[dict[str, Any]], None], gather: Gather | None) -> None:
        if self._complete_response is not None:  # answered by the context phase: no stream
            self.note(first_chunk_at=time.monotonic())
            if gather is not None:
                gather.hold()
            try:
                for chunk in completion_as_chunks(self._complete_response):
                    if self._hide_cache_hits:
                        hide_cached_tokens(chunk)
                    sink(chunk)
            except StopRelay:
                pass
            finally:
                if gather is not None:
                    gather.release()
            self.note(stage=Stage.DONE)
            return
        stream = self._stream
        assert stream is not None, "relay() before stream_ready()"
        feedback = self.feedback
        hide = self._hide_cache_hits
        span = stream.span  # the generation call's, when traced

        def on_chunk(chunk: dict[str, Any]) -> None:
            if self._first_chunk:  # the endpoint holds the prompt's prefix now
                self._first_chunk = False
                self.note(first_chunk_at=time.monotonic())
                feedback.on_first_chunk(self._generation_endpoint_id)
                if self.learns_prompt_tokens:
                    ids = chunk.pop("prompt_token_ids", None)
                    if isinstance(ids, list):
                        feedback.on_prompt_tokens(ids)
                if span is not None:
                    tracing.event(span, "gen_ai.first_token")
            if feedback.wants_usage and "usage" in chunk:
                feedback.on_usage(chunk["usage"])  # before hiding: the index reads the worker's real count
            if hide:
                hide_cached_tokens(chunk)
            sink(chunk)

        try:
            await stream.pump(on_chunk, gather)
        except WorkerError as exc:
            self.report(self._generation_endpoint_id, exc)
            stream.end_span(exc)
            raise
        except StopRelay:
            # Not drained (the pump drains only after [DONE]): closing it closes the connection.
            await stream.aclose()
            self._stream = None
        stream.end_span()  # the relay's end: the generation call's span ends with it
        self.report(self._generation_endpoint_id, None)
        self.note(stage=Stage.DONE)

    def pause_relay(self) -> None:
        """Read no more of the generation stream until `resume_relay`: backpressure from a client
        slower than its worker (its idle deadline does not run meanwhile)."""
        if self._stream is not None:
            self._stream.pause()

    def resume_relay(self) -> None:
        if self._stream is not None:
            self._stream.resume()

    # --- admission -------------------------------------------------------------------------------

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
        """Count the answer's tokens toward the run's share of the admission queue, once known."""
        if tokens > 0 and any(r.endpoint.capped for r in self._reservations):
            get_queue().charge(self.ticket, tokens)

    def _queued(self, started: float) -> None:
        waited = time.monotonic() - started
        if waited > 0.001:
            self.note(queued_s=self._progress.queued_s + waited)
            if tracing.on:  # the admission wait as a span of its own, recorded when there was one
                # (its pool and priority are the request span's gateway.pool and gateway.priority)
                tracing.past_child("gateway.admission", waited)

    # --- the steps a schedule takes (workers.schedule.schedules.Steps) -------------------------

    def note(self, **changes: Any) -> None:
        self._progress = replace(self._progress, **changes)

    async def reserve(self, role: Role, exclude: Sequence[str] = ()) -> Reservation:
        started = time.monotonic()
        reservation = await router.reserve(
            self.pool, role, self.request_id, session=self.session, exclude=exclude, placement=self._placement,
            ticket=self.ticket, tokens=self.tokens_in_flight,
        )
        self._queued(started)
        self._reservations.append(reservation)
        return reservation

    def report(self, endpoint_id: int, error: WorkerError | None) -> None:
        # The breaker decides what counts against the endpoint; the index forgets a failed worker.
        health.report(endpoint_id, error, tenant=self.tenant)
        if error is not None:
            self.feedback.on_failure(endpoint_id, error)

    def answered_in_full(self, response: dict[str, Any]) -> None:
        self._complete_response = response
        for reservation in self._reservations:
            if reservation.stage == Role.GENERATION and reservation.released_at is None:
                reservation.release(Outcome.SUCCESS)

    async def open_generation(self, body: dict[str, Any]) -> None:
        self.note(stage=Stage.GENERATION)
        if self.handoff_issued:
            # The request carries a handoff: as a task of its own, so that close() can let its
            # worker take the KV even if this run is cancelled meanwhile.
            self.start_generation(body)
            await self.await_generation()
            return
        # Nothing to release on a cancellation but the request itself: sent from this task, a
        # loop turn sooner than through a child task.
        await self.await_generation(self._stream_from_generation(body, self.rendered.dumps(body)))

    def start_generation(self, body: dict[str, Any], *, waits_for_context: bool = False) -> asyncio.Task[ChunkStream]:
        task = self._generation_opened.start(
            self._stream_from_generation(body, self.rendered.dumps(body), waits_for_context=waits_for_context)
        )
        self._generation_open = task
        return task

    async def await_generation(self, opening: Coroutine[Any, Any, ChunkStream] | None = None) -> None:
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
            self.report(self._generation_endpoint_id, exc)
            raise

    async def _stream_from_generation(self, body: dict[str, Any], payload: bytes, *, waits_for_context: bool = False) -> ChunkStream:
        """`payload`: `body` serialized (by the caller, while the rendered prompt is held)."""
        try:
            return await client.open_stream(
                self._generation_url + self.protocol.chat_path,
                payload,
                stage=Stage.GENERATION,
                headers=dict(self.protocol.headers(body, self.call)),
                waits_for_context=waits_for_context,
                wordings=protocols.error_wordings(),
            )
        except WorkerError as exc:
            explained = self.protocol.explain_error(exc, self.call)
            if explained is exc:
                raise
            raise explained from exc


__all__ = ["ChatRun"]
