"""The Channels consumers of the API routes.

Channels' stock `AsyncHttpConsumer` runs `handle()` inside its receive loop, so it never sees
`http.disconnect` while a response is being produced (`http_request` awaits `handle()` before it returns). Once the
body is complete these consumers run the work in the application's own task while another task
reads what comes next (`_dispatch_directly`; with a channel layer, the work goes to a task of its
own beside Channels' loop). The `http.disconnect` that arrives when the client goes away cancels
the work, and the cancellation reaches everything it owns (the pipeline, its worker requests,
the heartbeat).

Handlers raise; they never answer an error themselves. Whatever leaves the task — an
`AnthropicError`, a `WorkerError`, the request's deadline, a bug — reaches `_answer_error`, which
maps it (`errors.client_error`), ends the audit row once, and answers: an HTTP error before the
response started, an `error` event and the end of the stream after.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs

import orjson
from channels.exceptions import StopConsumer
from channels.generic.http import AsyncHttpConsumer
from channels.layers import get_channel_layer
from django.conf import settings

from disagg_project import drop_tracebacks
from messages_api import intake, metrics
from messages_api.server import loop_lag
from messages_api.accumulate import accumulate_message
from messages_api.server.arrival import seconds_since_received
from messages_api.audit import AuditRecord, sample_anonymous, sample_refused
from messages_api.auth import INVALID_KEY, MISSING_KEY, CredentialError, Principal, key_cache, key_from_headers
from messages_api.server.backpressure import Backpressure
from messages_api.server.body_writer import BodyWriter, body_writer
from messages_api.server.send_queue import SendQueue
from messages_api.errors import (
    AnthropicError,
    DeadlineExceeded,
    client_error,
    operator_detail,
)
from messages_api.heartbeat import Heartbeat
from messages_api.request_context import current_request_id
from messages_api.model_list import model_info, model_page
from messages_api.models import RequestStatus
from messages_api.reframe import StreamReframer
from messages_api.revocation import KeyRevoked, open_requests
from messages_api.framing import PING_FRAME, encode_events
from messages_api.limits import Usage, check_limits, refuse_early
from workers import ChatRun, PoolInfo, Priority, WorkerError, choose_pool, count_prompt_tokens, get_registry

if TYPE_CHECKING:
    from asgiref.typing import HTTPDisconnectEvent, HTTPRequestEvent

logger = logging.getLogger(__name__)


class ApiConsumer(AsyncHttpConsumer):
    """Body collection with a size limit, the task the request runs in, and JSON replies."""

    allowed_methods: tuple[str, ...] = ("POST",)

    @classmethod
    def max_body_bytes(cls) -> int:
        """The largest body the route takes (413 beyond); the intake guard asks it too (routes.body_limit)."""
        limit: int = settings.MESSAGES_MAX_BODY_BYTES
        return limit

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = AuditRecord()
        # Sent with every answer (the key's anthropic-ratelimit-* headers, once checked).
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.request_headers: dict[bytes, bytes] = {}
        self._body_size = 0
        self._task: asyncio.Task[None] | None = None
        # The request's work, once its body is complete, when it runs in the application's own
        # task (`_dispatch_directly`) rather than a task of its own.
        self._serves_in_place = False
        self._work: Coroutine[Any, Any, None] | None = None
        self._refused = False
        # Why the gateway cancelled the request while it ran (a revoked key, `revoke`; a stalled
        # client, `cut`): answered through the error boundary, not taken for the client gone.
        self._cut: AnthropicError | None = None
        self.response_started = False
        self.response_finished = False
        self.sent_status: int | None = None  # the status line sent, once it was
        self._body_writer: BodyWriter | None = None  # see send_body
        self._send_queue: SendQueue | None = None  # the body writer off daphne
        self._backpressure: Backpressure | None = None  # a stream's client pacing its worker, under daphne

    # Channels' stubs type every consumer's scope as a websocket scope (`_ChannelScope`); this
    # HTTP consumer reads HTTP keys from it and passes it on unchanged.
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # type: ignore[override]
        self.record.received_earlier(seconds_since_received(send))
        self.record.route = f"{scope.get('method', '')} {scope.get('path', '')}"
        try:
            if get_channel_layer(self.channel_layer_alias) is None:
                await self._dispatch_directly(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)  # type: ignore[arg-type]  # the same stubs' scope type
        finally:
            # The server cancelling the application (shutdown, application-close timeout) takes
            # the same path as a client disconnect: the request's task is cancelled and awaited.
            # Once: a task already cancelled (the client left first) is in its cleanup, and a
            # second cancellation would cut that short. Cancelled again while waiting, this
            # raises at once and the task finishes its cleanup on its own (asyncio.wait never
            # cancels what it waits for).
            task = self._task
            if task is not None and task is not asyncio.current_task() and not task.done():
                if not task.cancelling():
                    task.cancel()
                await asyncio.wait({task})

    async def _dispatch_directly(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """`AsyncConsumer.__call__` for a deployment without a channel layer, less its loop's cost.

        Channels reads every message through a new task and `asyncio.wait`, so even a request body
        already queued reaches `dispatch` four loop turns after the scope (`tests/unit/test_intake.py`
        counts them); under load each turn is a pass over every ready stream, and the status line
        waits for all of them. With no channel layer there is one source of messages, so reading
        it in place is the same loop: dispatch each message in order until a handler stops the
        consumer. disagg_project/relied_on.py pins Channels' version of this method (checked by
        tests/unit/test_relied_on.py), so a change there is seen.

        Once the body is complete the request is served in this task, the application's, and a
        task of its own watches what comes next (the disconnect): the request's start is then a
        turn sooner than from a task started for it (tests/e2e/test_loop_turns.py)."""
        self.scope = scope  # type: ignore[assignment]  # the stubs' websocket scope type, as above
        self.channel_layer = None  # type: ignore[assignment]  # the stubs say a layer; Channels sets None too
        self.base_send = send
        self._serves_in_place = True
        try:
            while self._work is None:
                await self.dispatch(await receive())
        except StopConsumer:
            return
        work, self._work = self._work, None
        self._task = asyncio.current_task()
        watcher = asyncio.get_running_loop().create_task(self._watch_for_disconnect(receive))
        try:
            await work
        finally:
            watcher.cancel()

    async def _watch_for_disconnect(self, receive: Any) -> None:
        """Beside a request served in place: the client's going away cancels it."""
        while (await receive())["type"] != "http.disconnect":
            pass  # the rest of a refused body
        task = self._task
        # Daphne also sends http.disconnect once a response is complete; the request is then
        # only finishing its bookkeeping and must not be cancelled.
        if task is not None and not task.done() and not self.response_finished:
            task.cancel()

    # --- ASGI message handlers ---------------------------------------------------------------

    async def dispatch(self, message: dict[str, Any]) -> None:
        # The stock dispatch closes stale DB connections on the shared ORM thread before every
        # message (a thread hop per 8 KiB body chunk); these consumers never touch the ORM here.
        # The stubs type `dispatch`'s message as any dict; its `type` says which event it is.
        if message["type"] == "http.request":
            await self.http_request(cast("HTTPRequestEvent", message))
        elif message["type"] == "http.disconnect":
            await self.http_disconnect(cast("HTTPDisconnectEvent", message))

    async def http_request(self, message: HTTPRequestEvent) -> None:
        if self._task is not None or self._refused:
            return
        if not self.request_headers:
            self.request_headers = dict(self.scope.get("headers") or ())
            declared = self.request_headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes():
                return self._refuse_too_large()
        chunk = message.get("body", b"")
        self._body_size += len(chunk)
        if self._body_size > self.max_body_bytes():
            return self._refuse_too_large()
        self.body.append(chunk)
        if not message.get("more_body", False):
            body, self.body = b"".join(self.body), []
            self._start(self._serve(body))

    async def http_disconnect(self, message: HTTPDisconnectEvent) -> None:
        task = self._task
        if task is not None and not task.done():
            # Daphne also sends http.disconnect once a response is complete; the task is then
            # only finishing its bookkeeping and must not be cancelled.
            if not self.response_finished:
                task.cancel()
            # `wait`, not `await task`: the task's own CancelledError is expected, but one aimed
            # at this consumer (the server giving up on it) must not be swallowed with it.
            await asyncio.wait({task})
        raise StopConsumer()

    def revoke(self) -> None:
        """The request's API key was revoked (messages_api/revocation.py): its task is cancelled,
        and `_serve` answers that cancellation with `KeyRevoked` instead of taking the client for gone."""
        self.cut(KeyRevoked())

    def cut(self, error: AnthropicError) -> None:
        """End the running request with `error` (idempotent; nothing once it has ended): its task is
        cancelled and `_serve` answers that cancellation with `error`."""
        task = self._task
        if self._cut is not None or task is None or task.done() or self.response_finished:
            return
        self._cut = error
        task.cancel()

    def _writer(self) -> BodyWriter:
        """Where middle frames go (see `send_body`): daphne's direct writer, or on another server
        a queue to `send`."""
        writer = self._body_writer
        if writer is None:
            writer = body_writer(self.base_send)
            if writer is None:
                writer = self._send_queue = SendQueue(self._send_middle)
            self._body_writer = writer
        return writer

    async def _send_middle(self, body: bytes) -> None:
        await super().send_body(body, more_body=True)

    async def send_body(self, body: bytes, *, more_body: bool = False) -> None:
        if more_body:
            # A middle frame (an SSE event, a ping), written without waiting: straight to daphne's
            # request under daphne (messages_api/server/body_writer.py), else queued for `send`
            # (messages_api/server/send_queue.py).
            self._writer()(body)
            return
        # The last frame goes through `send`, which ends the response, after every middle one.
        if self._send_queue is not None:
            await self._send_queue.flush()
        if self._backpressure is not None:
            self._backpressure.close()  # before daphne finishes the request (it must be unregistered)
        self.response_finished = True
        await super().send_body(body, more_body=False)

    def _refuse_too_large(self) -> None:
        # Answer at once; the rest of the body is never read into memory.
        self._refused = True
        self.body = []
        error = AnthropicError(
            413,
            f"Request body is larger than the limit of {self.max_body_bytes()} bytes",
            "request_too_large",
        )
        self._start(self._answer_error(error))

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        """Run the request's work: in place (`_dispatch_directly`), or as a task of its own beside
        Channels' receive loop, which must go on reading to see the disconnect."""
        if self._serves_in_place:
            self._work = work
        else:
            self._task = asyncio.create_task(work)

    async def _serve(self, body: bytes) -> None:
        """The request's task: everything it raises ends in `_answer_error`, the one boundary."""
        current_request_id.set(self.record.request_id)
        deadline_s = settings.MESSAGES_REQUEST_DEADLINE_S
        try:
            # The deadline counts from the request's arrival (its upload included) to the last byte.
            elapsed = time.monotonic() - self.record.received_monotonic
            deadline = asyncio.timeout(deadline_s - elapsed if deadline_s > 0 else None)
            try:
                async with deadline:
                    if self.scope.get("method") not in self.allowed_methods:
                        raise AnthropicError(
                            405,
                            f"Method {self.scope.get('method')} is not allowed here",
                            "invalid_request_error",
                            headers=((b"allow", ", ".join(self.allowed_methods).encode()),),
                        )
                    if loop_lag.monitor.overloaded():
                        loop_lag.shed.inc()
                        raise AnthropicError(529, "Overloaded", "overloaded_error", retry_after=1.0)
                    await self.handle_request(body)
            except TimeoutError as exc:
                if not deadline.expired():
                    raise  # someone else's timeout: a bug, answered as one
                raise DeadlineExceeded(deadline_s) from exc
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if self._cut is not None and task is not None and task.uncancel() == 0:  # cut, and the client is still here
                await self._answer_error(self._cut)
                return
            if self.record.begun:
                self.record.end(RequestStatus.CANCELLED, http_status=self.sent_status or 499)
            drop_tracebacks(exc)  # no one reads a cancellation's frames: they can go now
            raise
        except Exception as exc:
            await self._answer_error(exc)
        finally:
            if self._send_queue is not None:
                # The response is over (ended, failed, or its client gone): nothing more is sent.
                self._send_queue.close()
            if self._backpressure is not None:
                self._backpressure.close()  # and a stalled client's connection is aborted

    # --- the error boundary ----------------------------------------------------------------------

    async def _answer_error(self, exc: Exception) -> None:
        """The one place an error becomes an answer and an audit row, whatever raised it and
        whenever: an HTTP error before the response started, `send_late_error` after."""
        current_request_id.set(self.record.request_id)
        error = client_error(exc)
        unexpected = error is not exc and not isinstance(exc, WorkerError)
        if unexpected:
            logger.error("unhandled error", exc_info=exc)
        try:
            await self._record_error(exc, error)
            try:
                if not self.response_started:
                    await self.send_error(error)
                elif not self.response_finished:
                    await self.send_late_error(error)
            except Exception:
                # The client is gone, or the answer itself failed: the row is written either way.
                logger.warning("could not send the error answer", exc_info=True)
        finally:
            if not unexpected:
                # An expected error's frames are read by no one: dropped, the request is freed at
                # once. A bug's stay with it: its log line is written on another thread, later,
                # and prints the tracebacks of the errors chained to it.
                drop_tracebacks(exc)

    async def _record_error(self, exc: Exception, error: AnthropicError) -> None:
        """End the audit row: `rejected` for the client's own fault before any worker was asked,
        `failed` otherwise. A request refused before it was accepted is counted in the metrics
        (and its key's usage) always but written only as a sample — a known key's at
        AUDIT_REFUSED_SAMPLE_PER_S, the others' at AUDIT_UNAUTHENTICATED_SAMPLE_PER_S — so that a
        flood of refused requests cannot fill the database."""
        record = self.record
        if not record.begun and not record.api_key_name and error.status != 401:
            await self.identify()  # refused before authentication (405, 413): whose was it?
        detail = operator_detail(exc, error)
        persist = True
        if not record.begun:
            sampled = sample_refused(record.api_key_name, detail) if record.api_key_name else sample_anonymous(detail)
            persist = sampled is not None
            detail = sampled or detail
        record.end(
            RequestStatus.REJECTED if error.status < 500 and not record.begun else RequestStatus.FAILED,
            http_status=self.sent_status or error.status,
            error_type=error.error_type,
            error_message=detail,
            persist=persist,
        )

    async def send_late_error(self, error: AnthropicError) -> None:
        """End a response that has already started (a consumer that streams overrides this)."""
        await self.send_body(b"", more_body=False)

    # --- to implement --------------------------------------------------------------------------

    async def handle_request(self, body: bytes) -> None:
        raise NotImplementedError

    # --- helpers ---------------------------------------------------------------------------------

    async def authenticate(self) -> Principal:
        # Every header, not `request_headers` (a dict: the last of two x-api-key would win).
        try:
            key = key_from_headers(self.scope.get("headers") or ())
        except CredentialError as exc:
            raise AnthropicError(401, str(exc), "authentication_error") from None
        if not key:
            raise AnthropicError(401, MISSING_KEY, "authentication_error")
        principal = await key_cache.authenticate(key)
        if principal is None:
            raise AnthropicError(401, INVALID_KEY, "authentication_error")
        self.record.api_key_name, self.record.api_key_id = principal.name, principal.key_id or None
        return principal

    async def identify(self) -> None:
        """Name the key of a request refused before authentication (a 405, a 413), if it has a
        valid one, so that its audit row is attributed (and not sampled as anonymous)."""
        try:
            key = key_from_headers(self.scope.get("headers") or ())
        except CredentialError:
            return
        if not key:
            return
        try:
            principal = await key_cache.authenticate(key)
        except Exception:
            logger.warning("API key lookup failed while answering an error", exc_info=True)
            return
        if principal is not None:
            self.record.api_key_name, self.record.api_key_id = principal.name, principal.key_id or None

    def response_headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", content_type), (b"request-id", self.record.request_id.encode()), *self.extra_headers]

    async def send_json(self, status: int, data: Any, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
        self.response_started = True
        self.sent_status = status
        await self.send_response(
            status,
            orjson.dumps(data),
            headers=self.response_headers(b"application/json") + list(extra_headers),
        )

    async def send_error(self, error: AnthropicError) -> None:
        headers: list[tuple[bytes, bytes]] = list(error.headers)
        if error.retry_after is not None:
            headers.append((b"retry-after", str(max(1, round(error.retry_after))).encode()))
        await self.send_json(error.status, error.body(self.record.request_id), headers)


class MessagesConsumer(ApiConsumer):
    """`POST /v1/messages`, streamed and not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reframer: StreamReframer | None = None
        self.heartbeat: Heartbeat | None = None
        self.sse_started = False

    async def handle_request(self, body: bytes) -> None:
        try:
            await self.handle_message(body)
        finally:
            open_requests.discard(self)
            if self.sse_started:
                metrics.open_streams.dec()
            intake.release(len(body))

    async def handle_message(self, body: bytes) -> None:
        record = self.record
        principal = await self.authenticate()
        open_requests.add(principal.key_hash, self)  # revoking the key ends the request
        # A key this process already knows is over its limits is refused before its body is parsed.
        refuse_early(principal.key_hash, principal.limits)
        request, chat, rendered, cache_share = await intake.messages_request(body)
        record.model = request["model"]
        record.stream = bool(request.get("stream"))
        pool = await pool_for_model(request["model"], principal, chat)

        record.pool_name = pool.name
        run = ChatRun(
            chat, pool=pool, request_id=record.request_id, session=session_key(self.request_headers, request),
            tenant=record.api_key_name, priority=principal.priority, size=len(body),
            cache_salt=principal.cache_salt or None, rendered=rendered,
        )
        # Over a limit: 429 before the request is accepted (its row is `rejected`).
        lease = await check_limits(principal.key_hash, principal.limits, Usage(run.estimated_prompt_tokens, request["max_tokens"]))
        try:
            self.extra_headers = lease.headers
            record.begin()
            self.reframer = StreamReframer(
                message_id=new_message_id(),
                model=request["model"],
                stop_sequences=request.get("stop_sequences"),
                # message_start's count when the worker reports usage only at the end (a plain
                # OpenAI-compatible server has no per-chunk usage); the worker's count replaces it.
                input_tokens=run.estimated_prompt_tokens,
                cache_share=cache_share,
                # Enforced here, whatever the worker does: the relay stops at it (reframe.py).
                max_tokens=request["max_tokens"],
            )
            record.run = run  # the audit reads the run's progress (stage, endpoints, timings) when it writes
            try:
                async with run:
                    if record.stream:
                        await self.respond_streamed(run)
                    else:
                        await self.respond_json(run)
            finally:
                # Whichever way the run ended (the error boundary writes the failed or cancelled row).
                self.note_reply()
        finally:
            # Anthropic's input-token limits count what was written to the cache too.
            used = Usage((record.input_tokens or 0) + (record.cache_creation_input_tokens or 0), record.output_tokens or 0)
            lease.settle(used)
            run.charge_output(used.output_tokens)
        record.end(RequestStatus.COMPLETED, http_status=200)

    # --- the two kinds of answer -----------------------------------------------------------------

    async def respond_json(self, run: ChatRun) -> None:
        await run.stream_ready()
        self.record.progress()
        reframer = self.reframer
        assert reframer is not None
        events: list[dict[str, Any]] = []
        # Bounded: past max_tokens the reframer ends the message and the relay stops (reframe.py).
        await run.relay(lambda chunk: events.extend(reframer.feed(chunk)))
        events.extend(reframer.finish())
        message = accumulate_message(events)
        await self.send_json(200, message)

    async def respond_streamed(self, run: ChatRun) -> None:
        reframer = self.reframer
        assert reframer is not None
        early_start: asyncio.Task[None] | None = None

        def start_early() -> None:
            # Still in the context phase: the response starts now, kept alive by pings, while
            # the pipeline goes on in this task.
            nonlocal early_start
            early_start = asyncio.create_task(self.start_sse(first_frame=True))

        try:
            # The wait counts from the request's arrival, not from here: under a burst, time spent
            # queued behind other requests' start-up is part of what the client waits.
            remaining = settings.MESSAGES_STREAM_START_WAIT_S - (time.monotonic() - self.record.received_monotonic)
            try:
                await run.stream_ready(slow_after=remaining, on_slow=start_early)
            except BaseException:
                if early_start is not None:
                    # The error is answered after the status line, as a late error; the pipeline's
                    # error is the one answered, not a failure of the early start's.
                    await asyncio.wait({early_start})
                    if not early_start.cancelled():
                        early_start.exception()
                raise
            if early_start is not None:
                await early_start  # the stream's first event goes after the status line
            self.record.progress()
            if not self.sse_started:
                await self.start_sse(first_frame=False)
            writer = self._writer()
            # A client slower than its worker holds the worker's stream back.
            if self._send_queue is not None:
                self._send_queue.throttle(run.pause_relay, run.resume_relay)
            else:
                self._backpressure = Backpressure.register(
                    self.base_send, run.pause_relay, run.resume_relay, self.cut,
                    buffer_bytes=settings.MESSAGES_CLIENT_BUFFER_BYTES, stall_s=settings.MESSAGES_CLIENT_STALL_S,
                )
            frames = self._frame_writer(reframer, writer)
            await run.relay(frames.write_chunk, frames)
            closing = encode_events(reframer.finish())
            await self.stop_heartbeat()
            await self.send_body(closing, more_body=False)
        finally:
            await self.stop_heartbeat()

    async def send_late_error(self, error: AnthropicError) -> None:
        """The stream has started: end it with an error event (never message_stop after it)."""
        await self.stop_heartbeat()
        if not self.sse_started:
            await super().send_late_error(error)
            return
        try:
            assert self.reframer is not None
            # Closes the open content block first, as the SDKs' accumulators expect.
            events = self.reframer.fail(error.event())
        except Exception:
            logger.exception("the reframer failed while ending a stream")
            events = [error.event()]
        await self.send_body(encode_events(events), more_body=False)

    # --- the event stream ------------------------------------------------------------------------

    async def start_sse(self, *, first_frame: bool) -> None:
        self.response_started = True
        self.sent_status = 200
        self.sse_started = True
        metrics.open_streams.inc()
        await self.send_headers(
            status=200,
            headers=self.response_headers(b"text/event-stream; charset=utf-8")
            + [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")],
        )
        self.record.headers_sent_ms = self.record.since_received_ms()
        self.heartbeat = Heartbeat(settings.MESSAGES_PING_INTERVAL_S, self._send_ping)
        # Under daphne the status line leaves only with the first body chunk.
        if first_frame:
            await self.heartbeat.ping()
        else:
            # The first event usually follows at once; if the generation worker is slow to send
            # it, a ping carries the status line out by the end of the start wait all the same.
            self.heartbeat.due_at(self.record.received_monotonic + settings.MESSAGES_STREAM_START_WAIT_S)
        self.heartbeat.start()

    async def _send_ping(self) -> None:
        await self.send_body(PING_FRAME, more_body=True)

    def _frame_writer(self, reframer: StreamReframer, writer: BodyWriter) -> FrameWriter:
        """The sink of the stream (`ChatRun.relay`): each chunk's frames written as the worker's
        bytes arrive, in the worker connection's receive callback."""
        return FrameWriter(reframer, writer, self.heartbeat)

    async def stop_heartbeat(self) -> None:
        """Idempotent: every way out of a stream calls it before the last frame."""
        if self.heartbeat is not None:
            await self.heartbeat.stop()
            self.record.pings_sent = self.heartbeat.pings_sent

    def note_reply(self) -> None:
        """Copy what the reply did (pings, tokens) into the audit record; the run's own progress
        is read by the record itself."""
        record = self.record
        if self.heartbeat is not None:
            record.pings_sent = self.heartbeat.pings_sent
        if self.reframer is not None and self.reframer.started:
            record.input_tokens = self.reframer.input_tokens
            record.output_tokens = self.reframer.output_tokens
            record.cache_read_input_tokens = self.reframer.cache_read_input_tokens
            record.cache_creation_input_tokens = self.reframer.cache_creation_input_tokens


class FrameWriter:
    """A stream's chunks as SSE frames, written to the client as they come. Between `hold()` and
    `release()` (the chunks of one worker read that brought several: when the loop was busy, a
    paced stream's tokens pile up) the frames are gathered and leave in one write, one send."""

    __slots__ = ("_text_frame", "_reframer", "_writer", "_heartbeat", "_held")

    def __init__(self, reframer: StreamReframer, writer: BodyWriter, heartbeat: Heartbeat | None) -> None:
        self._text_frame = reframer.text_frame
        self._reframer = reframer
        self._writer = writer
        self._heartbeat = heartbeat
        self._held: list[bytes] | None = None

    def write_chunk(self, chunk: dict[str, Any]) -> None:
        # A text token on the open block (nearly every chunk) is framed without the event dict;
        # anything else goes through the reframer's general path.
        frames = self._text_frame(chunk)
        if frames is None:
            frames = _event_frames(self._reframer, chunk)
        if frames is None:
            return
        held = self._held
        if held is not None:
            held.append(frames)
            return
        self._writer(frames)
        if self._heartbeat is not None:
            self._heartbeat.sent()

    def hold(self) -> None:
        self._held = []

    def release(self) -> None:
        held, self._held = self._held, None
        if held:
            self._writer(held[0] if len(held) == 1 else b"".join(held))
            if self._heartbeat is not None:
                self._heartbeat.sent()


def _event_frames(reframer: StreamReframer, chunk: dict[str, Any]) -> bytes | None:
    """The SSE frames of a chunk that is not one more text token: the reframer's general path."""
    events = reframer.feed(chunk)
    return encode_events(events) if events else None


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


_SESSION_IN_USER_ID = re.compile(r"session_([0-9A-Za-z-]+)")


def session_key(headers: dict[bytes, bytes], request: dict[str, Any]) -> str | None:
    """Claude Code's session id (header, or inside `metadata.user_id`), for session affinity."""
    header = headers.get(b"x-claude-code-session-id")
    if header:
        return header.decode("latin-1")
    user_id = (request.get("metadata") or {}).get("user_id")
    if not isinstance(user_id, str) or not user_id:
        return None
    # Claude Code 2.1 sends a JSON object as a string ({"device_id", "account_uuid",
    # "session_id"}); earlier versions `user_<hash>_account_<uuid>_session_<uuid>`.
    try:
        decoded = orjson.loads(user_id)
    except orjson.JSONDecodeError:
        decoded = None
    session_id = decoded.get("session_id") if isinstance(decoded, dict) else None
    if isinstance(session_id, str) and session_id:
        return session_id
    match = _SESSION_IN_USER_ID.search(user_id)
    return match.group(1) if match else user_id


async def pool_for_model(model: str, principal: Principal, chat: dict[str, Any]) -> PoolInfo:
    """The pool to serve `model` (the first of its pools with room: spill-over), with the chat
    request renamed to the model its workers know. A model the key may not use is as unknown to
    it as a missing one."""
    snapshot = await get_registry().snapshot()
    served = snapshot.serving(model) if principal.may_use(model) else ()
    if not served:
        raise AnthropicError(404, f"model: {model}", "not_found_error")
    choice = choose_pool(served) if len(served) > 1 else served[0]
    chat["model"] = choice.upstream_model
    return choice.pool


class CountTokensConsumer(ApiConsumer):
    """`POST /v1/messages/count_tokens` → `{"input_tokens": N}`."""

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        request, chat = await intake.count_tokens_request(body)
        pool = await pool_for_model(request["model"], principal, chat)
        count = await count_prompt_tokens(pool, chat)
        await self.send_json(200, {"input_tokens": count})


class ModelsConsumer(ApiConsumer):
    """`GET /v1/models` and `GET /v1/models/{id}`: the exact public names (the catalogue's routes
    and the pools' own models) the key may use, in Anthropic's shape."""

    allowed_methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        snapshot = await get_registry().snapshot()
        models = [model_info(*public) for public in snapshot.public_models() if principal.may_use(public[0])]
        # URLRouter sets `url_route` on HTTP scopes too; the stubs' HTTPScope does not declare it.
        model_id = self.scope["url_route"]["kwargs"].get("model_id")  # type: ignore[typeddict-item]
        if model_id is not None:
            found = next((m for m in models if m["id"] == model_id), None)
            if found is None:
                raise AnthropicError(404, f"model: {model_id}", "not_found_error")
            await self.send_json(200, found)
            return
        await self.send_json(200, model_page(models, parse_qs(self.scope.get("query_string", b"").decode())))
