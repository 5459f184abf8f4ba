"""One chat request through the cluster: the context phase, then the generation stream.

    async with ChatRun(chat, pool=pool, request_id=rid) as run:
        run.start()                       # the pipeline runs as a child task
        if await run.wait_open(1.0): ...  # context done and the generation stream's headers in
        async for chunk in run.chunks(): ...

`ChatRun` owns every task, worker request and reservation it creates, and its exit releases them
exactly once whichever way the request ends: success, a worker failure, the client leaving
(cancellation), or a server shutdown. Three schedules, per pool:

- context first: reserve generation, POST `context_only`, then POST `generation_only` with the
  handoff and stream it;
- generation first: the generation request goes out first and waits on its worker for the KV of
  the request id; the context request follows; a context failure cancels the generation request;
- conditional: a prompt within `max_local_prefill_tokens` skips the context phase and goes whole to
  the reserved generation endpoint.

A client that leaves after the context worker issued its handoff must not strand the KV blocks
that handoff holds (reference/peers.md §0.1): the generation request is still dispatched, and
closed as soon as its worker has taken the handoff, in a detached task bounded by
`WORKER_HANDOFF_RELEASE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from django.conf import settings

from workers import client, router
from workers.client import ChunkStream
from workers.errors import StreamBroken, WorkerError, WorkerUnreachable
from workers.health import health
from workers.metrics import worker_retries
from workers.models import Outcome, Role, ScheduleStyle, Stage
from workers.protocols import trtllm
from workers.registry import PoolInfo
from workers.reservations import Reservation
from workers.tokens import estimate_prompt_tokens

logger = logging.getLogger(__name__)

# Handoff releases still running after their request ended (kept so they are not collected).
_detached: set[asyncio.Task[None]] = set()


class ChatRun:
    def __init__(
        self,
        chat: dict[str, Any],
        *,
        pool: PoolInfo,
        request_id: str,
        session: str | None = None,
    ) -> None:
        self.chat = chat
        self.pool = pool
        self.request_id = request_id
        self.session = session
        # Where the request is, and what it touched (read by the audit).
        self.stage: str = Stage.RECEIVED
        self.context_url: str = ""
        self.generation_url: str = ""
        self.prompt_tokens: int | None = None
        self.context_done_at: float | None = None
        self.first_chunk_at: float | None = None

        self._reservations: list[Reservation] = []
        self._open_task: asyncio.Task[None] | None = None
        self._generation_open: asyncio.Task[ChunkStream] | None = None
        self._stream: ChunkStream | None = None
        self._complete_response: dict[str, Any] | None = None
        self._handoff_issued = False
        self._generation_endpoint_id = 0

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

    def start(self) -> None:
        """Run the pipeline up to an open generation stream, as a child task."""
        if self._open_task is None:
            self._open_task = asyncio.create_task(self._open(), name=f"chat-run-{self.request_id}")

    async def wait_open(self, timeout: float | None) -> bool:
        """Wait up to `timeout` for the pipeline to open (or fail); True when it has finished."""
        self.start()
        assert self._open_task is not None
        done, _ = await asyncio.wait({self._open_task}, timeout=timeout)
        return bool(done)

    async def opened(self) -> None:
        """Wait for the generation stream to be open; raises the pipeline's WorkerError."""
        self.start()
        assert self._open_task is not None
        # Shield: cancelling the waiter must not cancel the pipeline behind the run's back; the
        # run's own close() cancels it in order.
        await asyncio.shield(self._open_task)

    async def close(self, outcome: str) -> None:
        """Cancel what is still running and release every reservation; idempotent."""
        task = self._open_task
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            # Let the child finish its own cleanup; a shutdown arriving meanwhile still wins.
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved here so asyncio does not log it as never retrieved
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
            reservation.release(outcome)

    # --- the pipeline ----------------------------------------------------------------------------

    async def _open(self) -> None:
        pool = self.pool
        generation = self._reserve(Role.GENERATION)
        self.generation_url = generation.endpoint.url
        self._generation_endpoint_id = generation.endpoint.id
        limit = pool.max_local_prefill_tokens
        if limit and estimate_prompt_tokens(self.chat) <= limit:
            await self._open_generation(trtllm.streamed(self.chat))
            return
        disagg_request_id = random.getrandbits(62)
        if pool.schedule_style == ScheduleStyle.GENERATION_FIRST:
            await self._generation_first(disagg_request_id)
        else:
            await self._context_first(disagg_request_id)

    async def _context_first(self, disagg_request_id: int) -> None:
        result = await self._context_phase(disagg_request_id)
        if result.complete_response is not None:
            self._complete_response = result.complete_response
            self._release_stage(Role.GENERATION, Outcome.SUCCESS)
            return
        body = trtllm.generation_request_after_context(self.chat, result)
        await self._open_generation(body)

    async def _generation_first(self, disagg_request_id: int) -> None:
        context = self._reserve(Role.CONTEXT)
        self.context_url = context.endpoint.url
        body = trtllm.generation_request_first(
            self.chat, disagg_request_id, context.endpoint.url, ScheduleStyle.GENERATION_FIRST
        )
        self.stage = Stage.CONTEXT
        generation_open = self._generation_open = asyncio.create_task(
            client.open_stream(self.generation_url + trtllm.CHAT_PATH, body, stage=Stage.GENERATION, waits_for_context=True)
        )
        context_phase = asyncio.create_task(self._context_phase(disagg_request_id, reservation=context))
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
        self.stage = Stage.GENERATION
        await self._await_generation()

    async def _context_phase(
        self, disagg_request_id: int, reservation: Reservation | None = None
    ) -> trtllm.ContextResult:
        """POST `context_only`; a connection failure before any answer is retried once elsewhere."""
        self.stage = Stage.CONTEXT
        body = trtllm.context_request(self.chat, disagg_request_id, self.pool.schedule_style)
        tried: list[str] = []
        # Generation-first already told its generation worker where the KV comes from.
        may_retry = reservation is None
        while True:
            if reservation is None:
                reservation = self._reserve(Role.CONTEXT, exclude=tried)
            self.context_url = reservation.endpoint.url
            try:
                response = await client.post_completion(
                    reservation.endpoint.url + trtllm.CHAT_PATH, body, stage=Stage.CONTEXT
                )
            except WorkerUnreachable:
                health.record_failure(reservation.endpoint.id)
                reservation.release(Outcome.FAILURE)
                tried.append(reservation.endpoint.url)
                reservation = None
                if not may_retry or len(tried) > 1 or not self._has_other(Role.CONTEXT, tried):
                    raise
                worker_retries.labels(Stage.CONTEXT).inc()
                continue
            except WorkerError as exc:
                if exc.status >= 500:
                    health.record_failure(reservation.endpoint.id)
                reservation.release(Outcome.FAILURE)
                raise
            except BaseException as exc:
                reservation.release(Outcome.CANCELLED if isinstance(exc, asyncio.CancelledError) else Outcome.FAILURE)
                raise
            health.record_success(reservation.endpoint.id)
            result = trtllm.read_context_response(response)
            reservation.release(Outcome.SUCCESS)
            self._handoff_issued = result.disaggregated_params is not None
            self.prompt_tokens = result.prompt_tokens
            self.context_done_at = time.monotonic()
            return result

    async def _open_generation(self, body: dict[str, Any]) -> None:
        self.stage = Stage.GENERATION
        self._generation_open = asyncio.create_task(
            client.open_stream(self.generation_url + trtllm.CHAT_PATH, body, stage=Stage.GENERATION)
        )
        await self._await_generation()

    async def _await_generation(self) -> None:
        assert self._generation_open is not None
        try:
            # Shielded so that a cancellation reaching us here leaves the decision (cancel, or
            # let the worker take the handoff first) to close().
            self._stream = await asyncio.shield(self._generation_open)
        except WorkerError as exc:
            if exc.status >= 500:
                health.record_failure(self._generation_endpoint_id)
            raise

    # --- the stream ------------------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The generation stream's chunks, after `opened()`."""
        if self._complete_response is not None:
            self.first_chunk_at = time.monotonic()
            for chunk in completion_as_chunks(self._complete_response):
                yield chunk
            self.stage = Stage.DONE
            return
        assert self._stream is not None, "chunks() before opened()"
        try:
            async for chunk in self._stream:
                if self.first_chunk_at is None:
                    self.first_chunk_at = time.monotonic()
                yield chunk
        except StreamBroken:
            health.record_failure(self._generation_endpoint_id)
            raise
        health.record_success(self._generation_endpoint_id)
        self.stage = Stage.DONE

    # --- helpers -----------------------------------------------------------------------------------

    def _reserve(self, role: str, exclude: list[str] | tuple[str, ...] = ()) -> Reservation:
        reservation = router.reserve(
            self.pool, role, self.request_id, session=self.session, exclude=exclude
        )
        self._reservations.append(reservation)
        return reservation

    def _release_stage(self, role: str, outcome: str) -> None:
        for reservation in self._reservations:
            if reservation.stage == role:
                reservation.release(outcome)

    def _has_other(self, role: str, tried: list[str]) -> bool:
        return bool(router.candidates(self.pool, role, exclude=tried))

    def _release_handoff_later(self, generation_open: asyncio.Task[ChunkStream]) -> None:
        task = asyncio.get_running_loop().create_task(
            _close_when_taken(generation_open, settings.WORKER_HANDOFF_RELEASE_TIMEOUT_S)
        )
        _detached.add(task)
        task.add_done_callback(_detached.discard)


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


__all__ = ["ChatRun", "WorkerError", "completion_as_chunks"]
