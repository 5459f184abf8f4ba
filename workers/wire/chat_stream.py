"""An open OpenAI chat stream from a worker (`workers.wire.client.open_stream` opens it), relayed
chunk by chunk as the worker's bytes arrive:

    stream = await open_stream(url, body, stage="generation", wordings=protocol.error_wordings)
    await stream.pump(sink)      # each validated chunk to `sink`, in the connection's receive callback
    await stream.aclose()

Its deadlines (the first byte, the idle gap between events, the whole call) are kept by one timer
per stream (`_StreamDeadline`); every failure leaves through the error boundary
(`workers.wire.boundary`), an error frame as the worker's own error (`workers.wire.error_reading`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx
import orjson
from django.conf import settings

from disagg_project import tracing
from workers.exceptions import StreamBroken, WorkerError
from workers.wire.boundary import boundary
from workers.wire.error_reading import Wordings, worker_error
from workers.wire.push import PushedBody, body_reader, push_body
from workers.wire.shapes import check_chunk
from workers.wire.sse_decoder import Event, SSEDecoder

# How long to wait for the end of a stream's body after `[DONE]`.
DRAIN_TIMEOUT_S = 1.0


class _StreamDeadline:
    """The deadline of one stream's reads, with one timer for the whole stream: when it passes,
    the outcome the stream's `pump` awaits fails with TimeoutError.

    A stream's deadline moves with every event (the idle gap counts from the last one), so moving
    it is an assignment, not a new timer per event (an `asyncio.timeout_at` around each read cost
    about as much as decoding the event: bench/results/2026-12-03-worker-transport-decision.md);
    the timer, when it fires early, re-arms itself for the deadline's new value. So a deadline
    moved later may be assigned to `when` directly (per relayed token); `move` is needed only for
    an earlier one.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, outcome: asyncio.Future[bool]) -> None:
        self.loop = loop
        self.when = float("inf")
        self._outcome = outcome
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for = float("inf")  # the timer's time (inf: none armed)

    def move(self, when: float) -> None:
        self.when = when
        if when < self._armed_for:  # only an earlier deadline needs the timer moved
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self.loop.call_at(when, self._fire)
            self._armed_for = when

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_for = float("inf")

    def _fire(self) -> None:
        self._handle = None
        self._armed_for = float("inf")
        if self.loop.time() < self.when:
            self._handle = self.loop.call_at(self.when, self._fire)  # moved later meanwhile
            self._armed_for = self.when
        elif not self._outcome.done():
            self._outcome.set_exception(TimeoutError())


class _SinkFailed(Exception):
    """Carries what a pushed stream's sink raised past the worker-error mapping."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


class Gather(Protocol):
    """A sink that can gather: the chunks of one read that brought several are delivered between
    `hold()` and `release()`, so that what they make can leave in one write."""

    def hold(self) -> None: ...

    def release(self) -> None: ...


class _Relay:
    """One `pump` of a stream, as the push's receiver: the worker's bytes arrive in `on_data`, in
    the connection's receive callback, and each event's checked chunk goes on to the sink there;
    the body's end or failure arrives in `on_end`. `outcome` is what `pump` awaits: True once
    `[DONE]` came, the stream's failure otherwise (a sink's own failure as `_SinkFailed`). Nothing
    is delivered once it is done.

    Per relayed token this is `on_data` and `deliver`: attributes are slots, and the bound methods
    (the push's `on_data` and `on_end`, the stream's `_chunk`) are taken once per stream, so a
    token allocates nothing here."""

    __slots__ = (
        "stream", "chunk_of", "sink", "gather", "outcome", "decoder", "deadline", "idle_s", "ends_by", "clock",
        "first_byte_due",
    )

    def __init__(
        self,
        stream: ChunkStream,
        sink: Callable[[dict[str, Any]], None],
        gather: Gather | None,
        outcome: asyncio.Future[bool],
        deadline: _StreamDeadline,
        clock: Callable[[], float],
    ) -> None:
        self.stream = stream
        self.chunk_of = stream._chunk  # bound once, not per event
        self.sink = sink
        self.gather = gather
        self.outcome = outcome
        self.decoder = SSEDecoder(settings.WORKER_MAX_SSE_LINE_BYTES)
        self.deadline = deadline
        self.idle_s = stream._idle_s
        self.ends_by = stream._ends_by
        self.clock = clock  # the loop's clock, read per token
        self.first_byte_due = stream._first_byte_by is not None  # the first byte's deadline runs

    def on_data(self, data: bytes) -> bool:
        """The body's next bytes: decoded, the deadline moved, the events delivered. False once
        the stream is over (the push then stops)."""
        outcome = self.outcome
        if outcome.done():  # the deadline passed meanwhile
            return False
        try:
            events = self.decoder.feed(data)
            # The first byte, then every complete event, restarts the idle gap.
            if self.first_byte_due:
                self.first_byte_due = False
                self.stream._first_byte_by = None
                self.deadline.move(min(self.clock() + self.idle_s, self.ends_by))
            elif events:
                # Later than the deadline before it (the clock only moves on; `ends_by` is
                # fixed), so an assignment, not `move`: the timer re-arms itself when it fires.
                # min() of the two, written out: the builtin parses its arguments on every call.
                idle_ends = self.clock() + self.idle_s
                ends_by = self.ends_by
                self.deadline.when = ends_by if ends_by < idle_ends else idle_ends
            # One event (a paced worker's token): straight on, no call more per token.
            if self.gather is None or len(events) < 2:
                return self.deliver(events)
            return self.deliver_gathered(events)
        except Exception as exc:  # malformed, an error frame, a line too long
            if not outcome.done():
                outcome.set_exception(exc)
            return False

    def on_end(self, error: BaseException | None) -> None:
        """The body's end (None: what the decoder still holds is delivered, and a body that
        ended without `[DONE]` fails as broken), or the connection's failure."""
        outcome = self.outcome
        if outcome.done():
            return
        if error is not None:  # the connection failed
            outcome.set_exception(error)
            return
        try:
            if self.deliver_gathered(self.decoder.end()):  # the body ended without [DONE]
                outcome.set_exception(self.stream._broken())
        except Exception as exc:
            if not outcome.done():
                outcome.set_exception(exc)

    def deliver(self, events: list[Event]) -> bool:
        """Pass on the events' chunks; False once the stream is over ([DONE] or a failure). An
        error frame or a malformed chunk raises."""
        chunk_of, sink = self.chunk_of, self.sink
        for event in events:
            chunk = chunk_of(event)
            if chunk is None:
                self.outcome.set_result(True)
                return False
            try:
                sink(chunk)
            except BaseException as exc:  # the consumer's own failure, raised as it is
                self.outcome.set_exception(_SinkFailed(exc))
                return False
        return True

    def deliver_gathered(self, events: list[Event]) -> bool:
        """`deliver`, several events between `gather.hold` and `gather.release` (released also
        when the sink or the stream failed halfway: what came before the failure goes out
        first); one event, or no gather, as `deliver`."""
        gather = self.gather
        if gather is None or len(events) < 2:
            return self.deliver(events)
        gather.hold()
        try:
            going_on = self.deliver(events)
        finally:
            try:
                gather.release()
            except BaseException as exc:  # the consumer's own failure, as in `deliver`
                if not self.outcome.done():
                    self.outcome.set_exception(_SinkFailed(exc))
        return going_on and not self.outcome.done()


class ChunkStream:
    """An open OpenAI chat stream: `pump` its validated chunks until `[DONE]`; close it when done.

    The response headers (status 200) have arrived when this exists. `pump` raises
    `StreamBroken` (or its subclasses `StreamTimedOut`, `MalformedChunk`) when the stream ends
    without `[DONE]`, goes silent past its deadlines or sends a malformed chunk, and the worker's
    `WorkerError` for an error frame (`event: error`, or a data frame `{"error": ...}`).
    """

    def __init__(
        self, response: httpx.Response, stage: str, *, first_byte_by: float, ends_by: float, wordings: Wordings = ()
    ) -> None:
        self._response = response
        self._stage = stage
        self._wordings = wordings  # the engine's, for an error frame
        self._first_byte_by: float | None = first_byte_by  # loop time; None once a byte came
        self._ends_by = ends_by  # loop time: the whole call's deadline
        self._deadline: _StreamDeadline | None = None
        self._idle_s: float = settings.WORKER_IDLE_TIMEOUT_S  # read once: this runs per token
        self._pumping = False
        self._push: PushedBody | None = None  # while `pump` runs
        self._paused = False
        #: The stream's CLIENT span when traced (disagg_project.tracing), else None: opened by
        #: `open_stream`, ended by whoever relays the stream (workers.schedule.pipeline.ChatRun).
        self.span: Any = None

    def end_span(self, error: BaseException | str | None = None) -> None:
        """End the stream's span, if traced and not ended yet (`error`: as `tracing.end`'s). Whoever
        ends the call ends it: the relay at its end or failure, the run's close, the cleanup of a
        stream never relayed."""
        span, self.span = self.span, None
        if span is not None:
            tracing.end(span, error)

    async def pump(self, sink: Callable[[dict[str, Any]], None], gather: Gather | None = None) -> None:
        """Each validated chunk to `sink` as it arrives, until `[DONE]`. `sink` runs in the worker
        connection's receive callback, so it must not wait (`pause` holds the worker back); what
        it raises ends the stream and is raised here as it is, never as the worker's failure.
        A read that brings several events (several tokens, when the loop was busy) is delivered
        between `gather.hold()` and `gather.release()`, if given: the sink may gather what it
        writes and send it at once. A read of one event (a paced worker's token) is delivered as
        it is.

        Why pushed: a stream relays one token per read, and a read the task awaits costs a
        future, a loop callback and a task step that resumes the reader through every `await`
        up to the consumer's loop; here the bytes reach the decoder, the chunk checks and `sink`
        in the call that received them."""
        loop = asyncio.get_running_loop()
        # True once [DONE] came; the stream's failure otherwise.
        outcome: asyncio.Future[bool] = loop.create_future()
        deadline = self._deadline = _StreamDeadline(loop, outcome)
        # The loop's clock, read per token: asyncio's is time.monotonic behind a Python method.
        clock = time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else loop.time
        relay = _Relay(self, sink, gather, outcome, deadline, clock)
        deadline.move(min(self._first_byte_by or loop.time() + self._idle_s, self._ends_by))
        self._pumping = True
        failed: BaseException | None = None
        try:
            # What has arrived already is pushed from here, before it returns.
            push = self._push = push_body(self._response, relay.on_data, relay.on_end)
            if push is None:  # open_stream's responses are always the worker transport's
                raise TypeError("a stream's response must come from the worker transport")
            if self._paused:  # by the sink, meanwhile
                push.pause_reading()
            with boundary(self._stage, streaming=True):
                try:
                    await outcome
                except _SinkFailed as exc:
                    failed = exc.error
        finally:
            self._pumping = False
            push, self._push = self._push, None
            if push is not None:
                push.stop()
                if self._paused:  # what remains of the body is read (drained, or closed) from here
                    push.resume_reading()
            self._paused = False
            deadline.close()
        if failed is not None:
            raise failed
        await self._drain(body_reader(self._response))

    def pause(self) -> None:
        """Read nothing more from the worker until `resume` (backpressure: a client slower than
        its worker). The idle gap does not count meanwhile, as it did not while a reader was
        busy elsewhere; the whole call's deadline does. Outside a `pump`, nothing to pause."""
        deadline = self._deadline
        if not self._pumping or deadline is None or self._paused:
            return
        self._paused = True
        deadline.when = self._ends_by  # later than the idle gap's: an assignment (see _StreamDeadline)
        if self._push is not None:
            self._push.pause_reading()

    def resume(self) -> None:
        """Read the worker again, its idle gap counted from now."""
        deadline = self._deadline
        if not self._paused or deadline is None:
            return
        self._paused = False
        deadline.move(min(deadline.loop.time() + self._idle_s, self._ends_by))
        if self._push is not None:
            self._push.resume_reading()

    def _broken(self) -> StreamBroken:
        return StreamBroken(
            502, f"the {self._stage} worker closed the stream before it was complete", stage=self._stage, code="stream_broken"
        )

    def _chunk(self, event: Event) -> dict[str, Any] | None:
        """The checked chunk an event carries; None for `[DONE]`."""
        data = event.data
        if event.event == "error":
            raise self._error_frame(data.encode())
        if data[:1] != "{" and data.strip() == "[DONE]":
            return None
        chunk = orjson.loads(data)
        if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
            raise self._error_frame(data.encode())
        return check_chunk(chunk)

    async def _drain(self, read: Callable[[], Awaitable[bytes]]) -> None:
        """Read the body's end after `[DONE]` (the chunked terminator follows at once) so the
        connection goes back to the pool instead of being closed half-read."""
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                while await read():
                    pass
        except (TimeoutError, httpx.HTTPError):
            pass  # the connection is closed instead of reused; the answer is complete anyway

    def _error_frame(self, body: bytes) -> WorkerError:
        status = 500
        try:
            err = orjson.loads(body).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            err = None
        if isinstance(err, dict) and type(err.get("code")) is int and 400 <= err["code"] < 600:
            status = err["code"]
        return worker_error(status, body, self._stage, wordings=self._wordings)

    async def aclose(self) -> None:
        if self._deadline is not None:
            self._deadline.close()
        await self._response.aclose()


__all__ = ["ChunkStream", "Gather"]
