"""workers.wire.client against a worker scripted byte by byte on a real socket: phase deadlines that a
trickling worker cannot stretch, size limits, malformed answers, error frames and scrubbed
error text, each ending as its WorkerError in time.

The fake worker here is tests/support/scripted.py's server with one scripted answer per test, and
an eye on when the gateway hangs up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from tests.support.scripted import ScriptedServer, read_request
from workers.exceptions import (
    AnswerTooLarge,
    ContextLengthExceeded,
    MalformedAnswer,
    MalformedChunk,
    StreamBroken,
    StreamTimedOut,
    WorkerError,
    WorkerTimeout,
)
from workers.protocols import error_wordings
from workers.wire import client
from workers.wire.chat_stream import ChunkStream

Script = Callable[[asyncio.StreamWriter], Awaitable[None]]

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CHUNK = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
COMPLETION = {"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}


class FakeWorker:
    """Answers every request with `script(writer)` after reading the request; records when the
    gateway hung up."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.hung_up = asyncio.Event()
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        try:
            if await read_request(reader) is not None:
                script = asyncio.create_task(self.script(writer))
                try:
                    await reader.read()  # EOF: the gateway closed the connection
                finally:
                    script.cancel()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        self.hung_up.set()


@asynccontextmanager
async def fake_worker(script: Script) -> AsyncIterator[FakeWorker]:
    worker = FakeWorker(script)
    async with ScriptedServer(worker.serve) as server:
        worker.url = server.url
        yield worker


def reply(*parts: bytes, every: float = 0.0, then_wait: bool = True) -> Script:
    """Write `parts` (each after `every` seconds), then stay silent with the connection open."""

    async def script(writer: asyncio.StreamWriter) -> None:
        for part in parts:
            if every:
                await asyncio.sleep(every)
            writer.write(part)
            await writer.drain()
        if then_wait:
            await asyncio.Event().wait()
        writer.close()

    return script


def trickle(data: bytes, every: float) -> Script:
    """One byte every `every` seconds: each read succeeds, so only an overall deadline ends it."""
    return reply(*(data[i : i + 1] for i in range(len(data))), every=every)


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (event if isinstance(event, bytes) else orjson.dumps(event)) + b"\n\n" for event in events)


def json_answer(body: bytes, status: str = "200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status.encode(), len(body), body)


ReadAll = Callable[..., Awaitable[list[dict[str, Any]]]]


@pytest.fixture
def read_all() -> ReadAll:
    """Reads a stream to its end (`ChunkStream.pump`, as the gateway relays), then closes it.
    Each chunk is collected and also handed to `on_chunk`, if given."""

    async def read(stream: ChunkStream, on_chunk: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []

        def collect(chunk: dict[str, Any]) -> None:
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)

        try:
            await stream.pump(collect)
            return chunks
        finally:
            await stream.aclose()

    return read


@pytest.fixture
def deadlines(settings: Any) -> Any:
    settings.WORKER_CONTEXT_TIMEOUT_S = 1.0
    settings.WORKER_FIRST_BYTE_TIMEOUT_S = 1.0
    settings.WORKER_IDLE_TIMEOUT_S = 0.6
    settings.WORKER_REQUEST_TIMEOUT_S = 30.0
    return settings


# --- deadlines -----------------------------------------------------------------------------------


async def elapsed(awaitable: Awaitable[Any]) -> tuple[BaseException, float]:
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        await awaitable
    return info.value, time.monotonic() - started


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(trickle(json_answer(orjson.dumps(COMPLETION)), 0.2), id="headers and body trickled"),
        pytest.param(reply(json_answer(orjson.dumps(COMPLETION))[:-5]), id="body stops"),
        pytest.param(reply(), id="no answer"),
    ],
)
async def test_the_context_call_ends_at_its_deadline_however_the_worker_trickles(deadlines: Any, script: Script) -> None:
    async with fake_worker(script) as worker:
        error, took = await elapsed(client.post_completion(worker.url, CHAT, stage="context"))
        await asyncio.wait_for(worker.hung_up.wait(), 5)  # and the connection is closed
    assert type(error) is WorkerTimeout
    assert (error.status, error.code, error.message) == (504, "timeout", "the context worker timed out")
    assert 0.9 < took < 3.0


async def test_headers_trickled_to_a_generation_request_end_at_the_first_byte_deadline(deadlines: Any) -> None:
    async with fake_worker(trickle(SSE_HEAD + sse(CHUNK), 0.2)) as worker:
        error, took = await elapsed(client.open_stream(worker.url, CHAT, stage="generation"))
    assert type(error) is WorkerTimeout and error.code == "timeout"
    assert 0.9 < took < 3.0


async def test_headers_without_a_body_end_at_the_first_byte_deadline(deadlines: Any, read_all: ReadAll) -> None:
    async with fake_worker(reply(SSE_HEAD)) as worker:
        started = time.monotonic()
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        error, _ = await elapsed(read_all(stream))
        took = time.monotonic() - started
        await asyncio.wait_for(worker.hung_up.wait(), 5)
    assert isinstance(error, StreamTimedOut) and isinstance(error, StreamBroken)
    assert (error.status, error.code) == (504, "timeout")
    assert 0.9 < took < 3.0


async def test_generation_first_waits_for_the_context_phase_before_its_first_byte(deadlines: Any, read_all: ReadAll) -> None:
    # The worker answers after 1.5 s: past the first-byte deadline alone, within it plus the
    # context phase's, which a generation-first request must allow.
    async with fake_worker(reply(SSE_HEAD + sse(CHUNK, b"[DONE]"), every=1.5)) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation", waits_for_context=True)
        assert await read_all(stream) == [CHUNK]
        error, _ = await elapsed(client.open_stream(worker.url, CHAT, stage="generation"))
    assert type(error) is WorkerTimeout


async def test_a_stream_trickling_bytes_that_complete_no_event_ends_at_the_idle_deadline(deadlines: Any, read_all: ReadAll) -> None:
    script = reply(SSE_HEAD + sse(CHUNK), *(b"data: {" for _ in range(100)), every=0.1)
    async with fake_worker(script) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        chunks: list[dict[str, Any]] = []
        started = time.monotonic()

        def seen(chunk: dict[str, Any]) -> None:
            nonlocal started
            chunks.append(chunk)
            started = time.monotonic()

        with pytest.raises(StreamTimedOut):
            await read_all(stream, seen)
        took = time.monotonic() - started
    assert chunks == [CHUNK]
    assert 0.5 < took < 2.0


async def test_a_stream_sending_events_for_ever_ends_at_the_request_deadline(deadlines: Any, read_all: ReadAll) -> None:
    deadlines.WORKER_REQUEST_TIMEOUT_S = 1.5
    script = reply(SSE_HEAD, *(sse(CHUNK) for _ in range(1000)), every=0.05)
    async with fake_worker(script) as worker:
        started = time.monotonic()
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        error, _ = await elapsed(read_all(stream))
    assert type(error) is StreamTimedOut
    assert 1.4 < time.monotonic() - started < 3.5


async def test_a_paused_stream_reads_nothing_and_its_idle_gap_waits(deadlines: Any, read_all: ReadAll) -> None:
    # Backpressure (a client slower than its worker) pauses the stream for longer than the idle
    # gap: the worker is not at fault, so it is no timeout; nothing is read meanwhile.
    async with fake_worker(reply(SSE_HEAD + sse(CHUNK), sse(CHUNK, b"[DONE]"), every=0.05)) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        seen_at: list[float] = []
        resumed_at = 0.0

        def resume() -> None:
            nonlocal resumed_at
            resumed_at = time.monotonic()
            stream.resume()

        def first_pauses(chunk: dict[str, Any]) -> None:
            seen_at.append(time.monotonic())
            if len(seen_at) == 1:
                stream.pause()
                asyncio.get_running_loop().call_later(1.0, resume)  # past the idle gap (0.6 s)

        assert await read_all(stream, first_pauses) == [CHUNK, CHUNK]
    assert seen_at[1] >= resumed_at > seen_at[0] + 0.9


async def test_a_paused_stream_still_ends_at_the_request_deadline(deadlines: Any, read_all: ReadAll) -> None:
    deadlines.WORKER_REQUEST_TIMEOUT_S = 1.5
    async with fake_worker(reply(SSE_HEAD + sse(CHUNK), sse(CHUNK, b"[DONE]"), every=0.05)) as worker:
        started = time.monotonic()
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        error, _ = await elapsed(read_all(stream, lambda _: stream.pause()))
    assert type(error) is StreamTimedOut
    assert 1.4 < time.monotonic() - started < 3.5


# --- sizes ---------------------------------------------------------------------------------------


async def test_a_declared_oversized_answer_is_refused_before_its_body(settings: Any) -> None:
    settings.WORKER_MAX_JSON_BYTES = 1024
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000000\r\n\r\n"
    async with fake_worker(reply(head)) as worker:
        error, took = await elapsed(client.post_completion(worker.url, CHAT, stage="context"))
    assert type(error) is AnswerTooLarge and error.status == 502 and error.code == "answer_too_large"
    assert took < 1.0


async def test_an_answer_growing_past_the_limit_is_cut_there(settings: Any) -> None:
    settings.WORKER_MAX_JSON_BYTES = 256 * 1024
    sent = 0

    async def endless(writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{\"a\": \"")
        while True:
            writer.write(b"x" * 65536)
            sent += 65536
            await writer.drain()

    async with fake_worker(endless) as worker:
        error, _ = await elapsed(client.post_completion(worker.url, CHAT, stage="context"))
        await asyncio.wait_for(worker.hung_up.wait(), 5)
    assert type(error) is AnswerTooLarge
    assert sent < 16 * 1024 * 1024  # cut near the limit (plus socket buffers), not read to the end


async def test_a_stream_line_longer_than_the_limit_is_refused(settings: Any, read_all: ReadAll) -> None:
    settings.WORKER_MAX_SSE_LINE_BYTES = 64 * 1024
    async with fake_worker(reply(SSE_HEAD + b"data: " + b"x" * 1024 * 1024)) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        error, took = await elapsed(read_all(stream))
    assert type(error) is MalformedChunk and error.code == "answer_too_large"
    assert error.message == "the generation worker sent a stream line longer than 65536 bytes"
    assert took < 2.0


# --- shapes --------------------------------------------------------------------------------------

MALFORMED = [
    (b'{"choices":[null]}', "choices[0] is not an object"),
    (b"[1,2,3]", "the chunk is not an object"),
    (b'{"choices":"abc"}', "choices is not a list"),
    (b"5", "the chunk is not an object"),
    (b'{"choices":[],"usage":5}', "usage is not an object"),
    (b'{"choices":[],"usage":{"prompt_tokens":"many"}}', "usage.prompt_tokens is not a non-negative integer"),
    (b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":{"a":1}}}]}}]}',
     "choices[0].delta.tool_calls[0].function.arguments is not a string"),
    (b'{"choices":[{"delta":null}]}', "choices[0].delta is missing or null"),
    (b'{"choices":[{"index":0,"delta":{"content":5}}]}', "choices[0].delta.content is not a string"),
    (b'{"choices":[{"index":0,"delta":{"content":{"a":1}}}]}', "choices[0].delta.content is not a string"),
    (b"{not json", "it is not JSON"),
]


@pytest.mark.parametrize(("frame", "named"), MALFORMED)
async def test_a_malformed_chunk_after_good_ones_ends_the_stream_with_its_field_named(frame: bytes, named: str, read_all: ReadAll) -> None:
    async with fake_worker(reply(SSE_HEAD + sse(CHUNK, frame, CHUNK, b"[DONE]"))) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        seen: list[dict[str, Any]] = []
        with pytest.raises(MalformedChunk) as info:
            await read_all(stream, seen.append)
    assert seen == [CHUNK]
    error = info.value
    assert isinstance(error, StreamBroken) and (error.status, error.code) == (502, "malformed_answer")
    assert error.message.startswith("the generation worker sent a malformed stream chunk: ") and error.message.endswith(named)


async def test_a_context_answer_of_the_wrong_shape_is_a_502_naming_the_field() -> None:
    answer = {"id": "c", "choices": [{"index": 0, "message": "oops", "finish_reason": "stop"}]}
    async with fake_worker(reply(json_answer(orjson.dumps(answer)))) as worker:
        error, _ = await elapsed(client.post_completion(worker.url, CHAT, stage="context"))
    assert type(error) is MalformedAnswer and error.status == 502
    assert error.message == "the context worker sent a malformed answer: choices[0].message is not an object"


async def test_multi_line_data_and_bare_cr_line_ends_arrive_as_chunks(read_all: ReadAll) -> None:
    body = b'data: {"id": "c",\rdata: "choices": []}\r\r: comment\r\ndata: [DONE]\r\n\r\n'
    async with fake_worker(reply(SSE_HEAD + body)) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        assert await read_all(stream) == [{"id": "c", "choices": []}]


# --- error frames and error text -----------------------------------------------------------------

PROBE = (
    "Traceback (most recent call last):\n  File \"/opt/tensorrt_llm/serve/openai_server.py\", line 412, in chat\n"
    "    raise RuntimeError(msg)\nRuntimeError: KV transfer from 10.20.30.40:8001 failed (api_key=sk-internal-123)\n"
)


async def test_a_worker_error_answer_reaches_the_client_scrubbed_and_the_audit_redacted(caplog: pytest.LogCaptureFixture) -> None:
    body = orjson.dumps({"error": {"message": PROBE, "type": "InternalServerError", "code": 500}})
    with caplog.at_level(logging.WARNING, logger="workers.wire.error_reading"):
        async with fake_worker(reply(json_answer(body, "500 Internal Server Error"))) as worker:
            error, _ = await elapsed(client.post_completion(worker.url, CHAT, stage="context"))
    assert error.status == 500
    assert error.message == "KV transfer from <address> failed (api_key=<redacted>"
    assert "10.20.30.40:8001" in error.detail and "/opt/tensorrt_llm" in error.detail
    assert "sk-internal-123" not in error.detail
    assert "sk-internal-123" in caplog.text  # the operator's log keeps the raw text


@pytest.mark.parametrize(
    "frame",
    [
        b"event: error\ndata: " + orjson.dumps({"error": {"message": PROBE, "code": 503}}) + b"\n\n",
        sse({"error": {"message": PROBE, "code": 503}}),
    ],
    ids=["event: error", "error data frame"],
)
async def test_an_error_frame_mid_stream_is_the_worker_error_scrubbed(frame: bytes, read_all: ReadAll) -> None:
    async with fake_worker(reply(SSE_HEAD + sse(CHUNK) + frame)) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        error, _ = await elapsed(read_all(stream))
    assert type(error) is WorkerError and error.status == 503
    assert error.message == "KV transfer from <address> failed (api_key=<redacted>"


async def test_context_length_is_read_from_the_raw_message_before_scrubbing() -> None:
    message = (
        "worker 10.0.0.5:8000: This model's maximum context length is 4096 tokens. However, you requested "
        "5000 tokens (4000 in the messages, 1000 in the completion)."
    )
    body = orjson.dumps({"error": {"message": message, "code": 400}})
    async with fake_worker(reply(json_answer(body, "400 Bad Request"))) as worker:
        error, _ = await elapsed(client.post_completion(worker.url, CHAT, stage="context", wordings=error_wordings()))
    assert isinstance(error, ContextLengthExceeded)
    assert (error.prompt_tokens, error.max_context_tokens) == (4000, 4096)
    assert "10.0.0.5" not in error.message and "10.0.0.5:8000" in error.detail


async def test_a_stream_ending_without_done_is_broken(read_all: ReadAll) -> None:
    async with fake_worker(reply(SSE_HEAD + sse(CHUNK), then_wait=False)) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        error, _ = await elapsed(read_all(stream))
    assert type(error) is StreamBroken and error.status == 502


async def test_a_client_leaving_during_a_watched_read_is_a_cancellation_not_a_timeout(deadlines: Any) -> None:
    # The stream's one deadline timer fails the pump when it passes; a cancellation from
    # elsewhere (the client left) must stay a cancellation and close the worker connection.
    async with fake_worker(reply(SSE_HEAD + sse(CHUNK))) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        got_one = asyncio.Event()
        task = asyncio.create_task(stream.pump(lambda _: got_one.set()))
        await asyncio.wait_for(got_one.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        await asyncio.wait_for(worker.hung_up.wait(), 5)
    assert task.cancelled()
    assert stream._deadline is not None and stream._deadline._handle is None  # its timer is gone


async def test_what_a_pushed_streams_sink_raises_is_raised_as_it_is_and_the_stream_closed() -> None:
    # The consumer's own failure is not the worker's: even a TimeoutError (which the worker
    # boundary maps to StreamTimedOut) must not come out as one, which would count against the
    # worker's health.
    def sink(chunk: dict[str, Any]) -> None:
        raise TimeoutError("the consumer's own deadline")

    async with fake_worker(reply(SSE_HEAD + sse(CHUNK, CHUNK))) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        with pytest.raises(TimeoutError) as info:
            await stream.pump(sink)
        assert not isinstance(info.value, WorkerError) and str(info.value) == "the consumer's own deadline"
        await stream.aclose()
        await asyncio.wait_for(worker.hung_up.wait(), 5)


@dataclass
class Gathering:
    """A `Gather` made of two functions."""

    hold: Callable[[], None]
    release: Callable[[], None]


def numbered(n: int) -> dict[str, Any]:
    return {**CHUNK, "choices": [{"index": 0, "delta": {"content": str(n)}, "finish_reason": None}]}


async def test_a_read_of_several_chunks_is_delivered_between_hold_and_release() -> None:
    # Three tokens in one write arrive in one read: held, delivered, released. The next read (one
    # token) is delivered as it is; the last ([DONE] alone) holds nothing.
    log: list[str] = []
    first_read_released = asyncio.Event()

    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + sse(numbered(1), numbered(2), numbered(3)))
        await writer.drain()
        await first_read_released.wait()
        writer.write(sse(numbered(4)))
        await writer.drain()
        while len(log) < 6:
            await asyncio.sleep(0.01)
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        await asyncio.Event().wait()

    def release() -> None:
        log.append("release")
        first_read_released.set()

    async with fake_worker(script) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        await stream.pump(lambda chunk: log.append(chunk["choices"][0]["delta"]["content"]),
                          Gathering(hold=lambda: log.append("hold"), release=release))
        await stream.aclose()
    assert log == ["hold", "1", "2", "3", "release", "4"]


async def test_what_the_sink_took_before_it_failed_is_released() -> None:
    taken: list[str] = []
    released: list[list[str]] = []

    def sink(chunk: dict[str, Any]) -> None:
        if len(taken) == 2:
            raise ValueError("the consumer's own failure")
        taken.append(chunk["choices"][0]["delta"]["content"])

    async with fake_worker(reply(SSE_HEAD + sse(numbered(1), numbered(2), numbered(3), numbered(4)))) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        with pytest.raises(ValueError, match="own failure"):
            await stream.pump(sink, Gathering(hold=lambda: None, release=lambda: released.append(list(taken))))
        await stream.aclose()
        await asyncio.wait_for(worker.hung_up.wait(), 5)
    assert released == [["1", "2"]]


async def test_a_failing_release_ends_the_stream_with_its_own_error() -> None:
    def release() -> None:
        raise ConnectionResetError("the client's connection")

    async with fake_worker(reply(SSE_HEAD + sse(CHUNK, CHUNK))) as worker:
        stream = await client.open_stream(worker.url, CHAT, stage="generation")
        with pytest.raises(ConnectionResetError) as info:
            await stream.pump(lambda chunk: None, Gathering(hold=lambda: None, release=release))
        assert not isinstance(info.value, WorkerError)
        await stream.aclose()
        await asyncio.wait_for(worker.hung_up.wait(), 5)
