"""`POST /v1/messages`, streamed and not, and the sink that writes a stream's frames."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from django.conf import settings

from messages_api import intake, metrics
from messages_api.answer import Answer, serve
from messages_api.consumers.base import ApiConsumer
from messages_api.consumers.state import ResponseState
from messages_api.errors import AnthropicError
from messages_api.framing import PING_FRAME, encode_events
from messages_api.heartbeat import Heartbeat
from messages_api.reframe import StreamReframer
from messages_api.revocation import open_requests
from messages_api.selection import session_key
from messages_api.server.backpressure import Backpressure
from messages_api.server.body_writer import BodyWriter

logger = logging.getLogger(__name__)


class MessagesConsumer(ApiConsumer):
    """`POST /v1/messages`: the request goes through `answer.serve`, the one path of every
    Messages request; this consumer only speaks HTTP (a JSON reply, or an event stream)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer: Answer | None = None
        # Set exactly when the event stream started (and is counted in `metrics.open_streams`).
        self.heartbeat: Heartbeat | None = None

    async def handle_request(self, body: bytes) -> None:
        try:
            principal = await self.authenticate()
            open_requests.add(principal.key_hash, self)  # revoking the key ends the request
            await serve(
                body, principal, self.record,
                priority=principal.priority, session_of=self._session, reply=self._reply,
            )
        finally:
            open_requests.discard(self)
            if self.heartbeat is not None:
                metrics.open_streams.dec()
            intake.release(len(body))

    def _session(self, request: dict[str, Any]) -> str | None:
        return session_key(self.request_headers, request)

    async def _reply(self, answer: Answer) -> None:
        self.answer = answer
        self.extra_headers = answer.headers
        if self.record.stream:
            await self.respond_streamed(answer)
        else:
            await self.send_json(200, await answer.message())

    # --- the event stream ------------------------------------------------------------------------

    async def respond_streamed(self, answer: Answer) -> None:
        run, reframer = answer.run, answer.reframer
        early_start: asyncio.Task[None] | None = None

        def start_early() -> None:
            # Still in the context phase: the response starts now, kept alive by pings, while
            # the pipeline goes on in this task.
            nonlocal early_start
            if self.state is ResponseState.ANSWERING and early_start is None:
                early_start = asyncio.create_task(self.start_sse(first_frame=True))

        async def start_queued() -> None:
            # Waiting in the admission queue: the response starts now, in this request's step
            # (under a burst, a task of its own would run only after every other request's start).
            if self.state is ResponseState.ANSWERING and early_start is None:
                await self.start_sse(first_frame=True)

        try:
            # The wait counts from the request's arrival, not from here: under a burst, time spent
            # queued behind other requests' start-up is part of what the client waits.
            remaining = settings.MESSAGES_STREAM_START_WAIT_S - (time.monotonic() - self.record.received_monotonic)
            try:
                await run.stream_ready(slow_after=remaining, on_slow=start_early, on_wait=start_queued)
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
            if self.state is ResponseState.ANSWERING:
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
            frames = FrameWriter(reframer, writer, self.heartbeat)
            await answer.relay(frames.write_chunk, frames)
            closing = encode_events(reframer.finish())
            await self.stop_heartbeat()
            await self.send_body(closing, more_body=False)
        finally:
            await self.stop_heartbeat()

    async def send_late_error(self, error: AnthropicError) -> None:
        """The stream has started: end it with an error event (never message_stop after it)."""
        await self.stop_heartbeat()
        if self.state is not ResponseState.STREAMING:
            await super().send_late_error(error)
            return
        try:
            assert self.answer is not None
            # Closes the open content block first, as the SDKs' accumulators expect.
            events = self.answer.reframer.fail(error.event())
        except Exception:
            logger.exception("the reframer failed while ending a stream")
            events = [error.event()]
        await self.send_body(encode_events(events), more_body=False)

    async def start_sse(self, *, first_frame: bool) -> None:
        self.state = ResponseState.STREAMING
        self.sent_status = 200
        self.heartbeat = Heartbeat(settings.MESSAGES_PING_INTERVAL_S, self._send_ping)
        metrics.open_streams.inc()
        await self.send_headers(
            status=200,
            headers=self.response_headers(b"text/event-stream; charset=utf-8")
            + [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")],
        )
        self.record.headers_sent_ms = self.record.since_received_ms()
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

    async def stop_heartbeat(self) -> None:
        """Idempotent: every way out of a stream calls it before the last frame."""
        if self.heartbeat is not None:
            await self.heartbeat.stop()
            self.record.pings_sent = self.heartbeat.pings_sent


class FrameWriter:
    """A stream's chunks as SSE frames, written to the client as they come (the sink of
    `ChatRun.relay`, called in the worker connection's receive callback). Between `hold()` and
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
