"""The worker transport (workers.wire.transport, on aiohttp; bodies read or pushed by workers.wire.push) against real TCP servers whose answers each
test scripts byte by byte: keep-alive reuse, framing, the retry of a stale kept-alive connection,
timeouts, the pool bound, back-pressure, closing a half-read answer, bounded response heads, TLS.
Each test states what worker calls need, not how the transport does it (until issue 10 the same
tests ran against a hand-written transport too)."""

from __future__ import annotations

import asyncio
import gc
import gzip
import ssl
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.chunked import LAST_CHUNK, chunk
from tests.support.scripted import Request, ScriptedServer, answering, read_request, response
from tests.support.tls import self_signed_certificate
from tests.support.worker_transport import Pushed, answer_every_request, fetch, ok, wait_for, worker_transport
from workers.exceptions import WorkerError
from workers.wire import client
from workers.wire import transport as transport_module
from workers.wire.push import body_reader, push_body
from workers.wire.transport import BODY_SLICE_BYTES


@pytest.mark.parametrize("via_httpx", [False, True], ids=["send", "httpx-interface"])
async def test_keep_alive_reuses_one_connection_and_sends_the_request_intact(via_httpx: bool) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while request := await read_request(reader):
            seen.append(request.raw)
            writer.write(ok(b"answer %d" % len(seen)))

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        first = await fetch(transport, server.url + "/v1/chat?x=1", body=b'{"a": 1}', via_httpx=via_httpx)
        second = await fetch(transport, server.url + "/v1/chat?x=1", via_httpx=via_httpx)
    assert (first.status_code, first.content, second.content) == (200, b"answer 1", b"answer 2")
    assert server.connections == 1
    head, _, body = seen[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat?x=1 HTTP/1.1\r\n")
    assert b"content-length: 8" in head.lower() and body == b'{"a": 1}'


@pytest.mark.parametrize("via_httpx", [False, True], ids=["send", "httpx-interface"])
async def test_a_large_body_arrives_whole_with_its_length_and_on_a_retry_too(via_httpx: bool) -> None:
    # Bodies past BODY_SLICE_BYTES go out a slice at a time: still framed by Content-Length (an
    # engine may not take a chunked request), and the stale keep-alive retry sends all of it again.
    large = bytes(range(256)) * (3 * BODY_SLICE_BYTES // 256 + 7)
    seen: list[Request] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        request = await read_request(reader)
        assert request is not None
        seen.append(request)
        if number == 1:
            writer.write(ok(b"first"))
            await writer.drain()
            await reader.read(1)  # the reuse's first bytes: hang up without a word
            return
        writer.write(ok(b"retried"))
        await answer_every_request(reader, writer, number)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        assert (await fetch(transport, server.url, body=large, via_httpx=via_httpx)).content == b"first"
        assert (await fetch(transport, server.url, body=large, via_httpx=via_httpx)).content == b"retried"
    assert server.connections == 2
    for request in seen:
        fields = {name.lower(): value for name, value in request.fields}
        assert fields["content-length"] == str(len(large)) and "transfer-encoding" not in fields
        assert request.body == large


async def test_a_large_body_leaves_in_slices_a_small_one_in_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    # Written in one piece, a 32 MiB body held the event loop for its whole copy into the socket's
    # buffer (~77 ms a request, bench/large_requests.py); a slice at a time, each waits for the
    # socket to drain.
    sliced: list[int] = []
    real_slices = transport_module._slices

    async def spy(body: bytes) -> AsyncIterator[memoryview]:
        async for piece in real_slices(body):
            sliced.append(len(piece))
            yield piece

    monkeypatch.setattr(transport_module, "_slices", spy)
    large = b"x" * (2 * BODY_SLICE_BYTES + 5)
    async with ScriptedServer(answer_every_request) as server, worker_transport() as transport:
        assert (await fetch(transport, server.url, body=b"small")).status_code == 200
        assert sliced == []
        assert (await fetch(transport, server.url, body=large)).status_code == 200
    assert sliced == [BODY_SLICE_BYTES, BODY_SLICE_BYTES, 5]


async def test_a_chunked_stream_arrives_as_it_is_sent() -> None:
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
        writer.write(b"6\r\ndata:1\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        await answer_every_request(reader, writer, 0)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        assert response.headers["content-type"] == "text/event-stream"
        chunks = response.aiter_raw()
        assert await anext(chunks) == b"data:1"  # before the rest was even sent
        go_on.set()
        assert [chunk async for chunk in chunks] == [b"data:2"]
        await response.aclose()
        assert (await fetch(transport, server.url)).content == b"hello"
    assert server.connections == 1  # read to its end: the connection went back to the pool


async def test_a_body_ending_with_the_connection_is_complete_and_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        assert (await fetch(transport, server.url)).content == b"until the end"
        assert (await fetch(transport, server.url)).content == b"until the end"
    assert server.connections == 2


async def test_a_kept_alive_connection_the_server_dropped_is_retried_on_a_fresh_one() -> None:
    # The keep-alive race: the server gives up on the idle connection just as the next request
    # goes out on it. The request never reached the server, so it is sent once more.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number == 1:
            writer.write(ok(b"first"))
            await writer.drain()
            await read_request(reader)  # the reuse: hang up without a word
            return
        writer.write(ok(b"retried"))
        await answer_every_request(reader, writer, number)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        assert (await fetch(transport, server.url)).content == b"first"
        assert (await fetch(transport, server.url)).content == b"retried"
    assert server.connections == 2


async def test_a_fresh_connection_closed_without_an_answer_fails_without_a_retry() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await fetch(transport, server.url)
        assert caught.value.request.url == httpx.URL(server.url)
    assert server.connections == 1


async def test_an_idle_connection_closed_by_the_server_is_not_reused() -> None:
    closed: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        writer.write(ok(b"%d" % number))
        await writer.drain()
        writer.close()  # a keep-alive timeout, before the client's next request
        await writer.wait_closed()
        closed.append(number)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        assert (await fetch(transport, server.url)).content == b"1"
        await wait_for(lambda: closed == [1])
        assert (await fetch(transport, server.url)).content == b"2"  # sent once, on a new connection
    assert server.connections == 2


async def test_an_expired_idle_connection_is_closed_instead_of_reused() -> None:
    async with ScriptedServer(answer_every_request) as server, worker_transport(keepalive_expiry=0.05) as transport:
        await fetch(transport, server.url)
        await asyncio.sleep(0.1)  # the expiry itself is what is tested
        await fetch(transport, server.url)
    assert server.connections == 2


async def test_a_worker_that_never_answers_times_out_and_sees_the_connection_close() -> None:
    client_left = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await reader.read()  # returns at EOF: the client hung up
        client_left.set()

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        with pytest.raises(httpx.ReadTimeout):
            await fetch(transport, server.url, timeout=0.1)
        await asyncio.wait_for(client_left.wait(), 5)


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with ScriptedServer(answer_every_request) as server:
        url = server.url
    async with worker_transport(max_connections=1) as transport:
        for _ in range(2):  # the failed attempt gave its pool slot back: no pool timeout
            with pytest.raises(httpx.ConnectError):
                await fetch(transport, url, timeout=1.0)


async def test_the_pool_bound_makes_a_request_wait_for_a_connection_or_time_out() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await release.wait()
        writer.write(ok())
        await answer_every_request(reader, writer, 0)

    async with ScriptedServer(handler) as server, worker_transport(max_connections=1) as transport:
        first = asyncio.create_task(fetch(transport, server.url))
        await wait_for(lambda: server.connections == 1)
        # Either name means "no connection to this worker", which the client maps alike.
        with pytest.raises((httpx.PoolTimeout, httpx.ConnectTimeout)):
            await fetch(transport, server.url, timeout=0.1)
        waiting = asyncio.create_task(fetch(transport, server.url))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        release.set()
        assert (await first).status_code == 200
        assert (await waiting).status_code == 200
    assert server.connections == 1


async def test_closing_a_half_read_answer_closes_the_connection() -> None:
    client_left = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number > 1:
            writer.write(ok())
            return
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()
        client_left.set()

    async with ScriptedServer(handler) as server, worker_transport(max_connections=1) as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        assert await anext(response.aiter_raw()) == b"first"
        await response.aclose()
        await asyncio.wait_for(client_left.wait(), 5)
        # Its pool slot is free again: the next request gets a connection at once.
        assert (await fetch(transport, server.url, timeout=1.0)).content == b"hello"
    assert server.connections == 2


async def test_a_connection_lost_mid_body_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        with pytest.raises(httpx.TransportError):
            await fetch(transport, server.url)


async def last_word_then_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    """A chunked answer whose one chunk comes a moment after its head; then the connection dies
    mid-body (the handler returns)."""
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(b"9\r\nlast word\r\n")
    await writer.drain()


async def test_bytes_that_arrived_before_the_connection_was_lost_come_before_the_error() -> None:
    """A worker's last tokens before it died are part of the answer. aiohttp raises a lost
    connection as soon as it has seen it, even while bytes that arrived before it are still
    buffered; the transport hands those over first."""
    async with ScriptedServer(last_word_then_gone) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        content = response.stream._response.content  # type: ignore[attr-defined]
        # Nobody is reading while the chunk and the end of the connection arrive together.
        await wait_for(lambda: content.exception() is not None)
        received = b""
        with pytest.raises(httpx.TransportError):
            async for chunk in response.aiter_raw():
                received += chunk
        assert received == b"last word"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_unread_answer_stops_reading_from_the_socket(chunked: bool) -> None:
    # Back-pressure: the gateway does not buffer an answer its client is not taking (a chunked
    # body goes through workers.wire.connection's decoder, any other through aiohttp's parser).
    payload = b"x" * (16 * 1024 * 1024)  # more than the kernel buffers of both sides hold

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        if chunked:
            pieces = [payload[i : i + 60_000] for i in range(0, len(payload), 60_000)]
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"".join(map(chunk, pieces)) + LAST_CHUNK)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        writer = server.writers[0]
        await wait_for(lambda: writer.transport.get_write_buffer_size() > 0)
        await asyncio.sleep(0.05)
        assert writer.transport.get_write_buffer_size() > 0  # still stuck: the client is not reading
        content = response.stream._response.content  # type: ignore[attr-defined]
        assert content._size < 1024 * 1024  # what the gateway holds meanwhile is bounded
        body = b"".join([chunk async for chunk in response.aiter_raw()])
    assert body == payload


async def test_malformed_answers_and_interim_answers() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after continue"))
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await answer_every_request(reader, writer, 0)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        assert (await fetch(transport, server.url)).content == b"after continue"
        with pytest.raises(httpx.RemoteProtocolError):  # on the same, kept-alive connection
            await fetch(transport, server.url)


async def test_https_workers_are_verified_and_kept_alive(tmp_path: Path) -> None:
    cert_path, key_path = self_signed_certificate(tmp_path, stem="worker")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert_path, key_path)
    async with ScriptedServer(answer_every_request, ssl=server_tls) as server:
        url = server.url + "/v1/chat/completions"
        assert url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(cert_path))
        async with worker_transport(ssl_context=trusting) as transport:
            assert (await fetch(transport, url)).content == b"hello"
            assert (await fetch(transport, url)).content == b"hello"
        assert server.connections == 1
        async with worker_transport() as transport:  # the system's CAs do not know this certificate
            with pytest.raises(httpx.ConnectError):
                await fetch(transport, url)


# --- bounded response heads ------------------------------------------------------------------------

HUGE_HEAD = 200_000 * 400  # 200,000 header lines of 400 bytes: 80 MB


def header_line(number: int, size: int = 400) -> bytes:
    name = b"x-header-%06d: " % number
    return name + b"v" * (size - len(name) - 2) + b"\r\n"


def many_headers(batch: int) -> bytes:
    """The next `batch` lines of 200,000 small header fields."""
    return b"".join(header_line(batch * 1000 + i) for i in range(1000))


def large_headers(batch: int) -> bytes:
    """The next lines of header fields under aiohttp's per-field bound, each 8,000 bytes."""
    return b"".join(header_line(batch * 50 + i, 8000) for i in range(50))


def one_endless_header(batch: int) -> bytes:
    """One header line that never ends."""
    return (b"x-endless: " if batch == 0 else b"") + b"v" * 400_000


class HugeHeadServer(ScriptedServer):
    """Answers with a status line, then head bytes from `lines(batch)` until HUGE_HEAD bytes are
    sent or the client hangs up; records how many bytes it got out."""

    def __init__(self, lines: Callable[[int], bytes]) -> None:
        super().__init__(self._answer)
        self.lines = lines
        self.sent = 0
        self.done = asyncio.Event()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\n")
            batch = 0
            while self.sent < HUGE_HEAD:
                data = self.lines(batch)
                writer.write(data)
                await writer.drain()
                self.sent += len(data)
                batch += 1
            writer.write(b"content-length: 0\r\n\r\n")
        finally:
            self.done.set()


@pytest.mark.parametrize("lines", [many_headers, large_headers, one_endless_header], ids=["count", "size", "line"])
async def test_a_huge_response_head_is_cut_at_the_limit_without_buffering_it(lines: Callable[[int], bytes]) -> None:
    async with HugeHeadServer(lines) as server, worker_transport() as transport:
        started = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError):
            await fetch(transport, server.url, timeout=10.0)
        elapsed = time.monotonic() - started
        await asyncio.wait_for(server.done.wait(), 10)  # the hang-up stopped the server's writes
    assert elapsed < 2.0
    # Cut early: what left the server is what the two kernels' socket buffers held, not 80 MB.
    assert server.sent < 16 * 1024 * 1024, server.sent


async def test_a_head_within_the_limits_is_accepted_and_one_past_them_is_not() -> None:
    # Each with a content-length field too: 5 fields of 619 bytes, 6 fields, 5 fields of 1,059 bytes.
    heads = {
        "/five-fields": b"".join(header_line(i, 150) for i in range(4)),
        "/six-fields": b"".join(header_line(i, 100) for i in range(5)),
        "/too-many-bytes": b"".join(header_line(i, 260) for i in range(4)),
    }

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while request := await read_request(reader):
            path = request.path
            writer.write(b"HTTP/1.1 200 OK\r\n" + heads[path] + b"content-length: 2\r\n\r\nok")

    async with ScriptedServer(handler) as server, worker_transport(
        max_response_headers=5, max_response_header_bytes=1024
    ) as transport:
        response = await fetch(transport, server.url + "/five-fields")
        assert (response.status_code, len(response.headers)) == (200, 5)
        for path in ("/six-fields", "/too-many-bytes"):
            with pytest.raises(httpx.RemoteProtocolError):
                await fetch(transport, server.url + path)


async def test_the_client_maps_a_huge_head_to_a_worker_error() -> None:
    async with HugeHeadServer(many_headers) as server:
        with pytest.raises(WorkerError) as caught:
            await client.post_json(server.url + "/v1/chat/completions", {}, stage="context", timeout=10.0)
        await client.transport().aclose()
    assert server.sent < 16 * 1024 * 1024  # cut at the limit, not read to the end
    assert caught.value.status >= 500
    assert "127.0.0.1" not in str(caught.value)


@pytest.mark.parametrize("encoding", [None, "gzip"])
async def test_the_client_reads_a_json_answer_whole_and_a_compressed_one_decoded(encoding: str | None) -> None:
    # The client reads an answer straight from the transport; a worker that compresses it anyway
    # (the gateway asks for no encoding) is read through httpx's decoders.
    answer = orjson.dumps({"ids": list(range(20_000))})
    headers = {"content-encoding": encoding} if encoding else None
    wire = gzip.compress(answer) if encoding else answer
    respond = answering(lambda _: response(200, wire, content_type="application/json", headers=headers))
    async with ScriptedServer(respond) as server:
        got = await client.post_json(server.url + "/v1/chat/completions", {}, stage="context", timeout=10.0)
        again = await client.post_json(server.url + "/v1/chat/completions", {}, stage="context", timeout=10.0)
        await client.transport().aclose()
    assert got == again == {"ids": list(range(20_000))}
    assert server.connections == 1


# --- pushed bodies (workers.wire.push.push_body: aiohttp's reader internals, checked here) -----------------


async def test_a_pushed_body_arrives_in_the_receive_callback_as_it_is_sent() -> None:
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:1\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"6\r\ndata:2\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"0\r\n\r\n")
        await answer_every_request(reader, writer, 0)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        content = response.stream._response.content  # type: ignore[attr-defined]
        await wait_for(lambda: bool(content._buffer))  # the first chunk arrived before anyone reads
        pushed = Pushed()
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        assert pushed.data == [b"data:1"]  # what had arrived, at once
        go_on.set()
        await wait_for(lambda: len(pushed.data) == 2)
        assert pushed.data == [b"data:1", b"data:2"]
        await asyncio.wait_for(pushed.ended.wait(), 5)
        assert pushed.error is None
        push.stop()
        await response.aclose()
        assert (await fetch(transport, server.url)).content == b"hello"
    assert server.connections == 1  # pushed to its end: the connection went back to the pool


async def test_closing_an_answer_mid_push_closes_the_connection() -> None:
    """A client hanging up mid-stream: the relay's push stops and the response is closed while
    the worker is still sending. The worker must see the connection close (it is how a real
    engine learns to abort the request), and the half-read connection must not go back to the
    pool."""
    worker_saw_close = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number > 1:
            writer.write(ok())
            return
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:1\r\n")
        await writer.drain()
        await reader.read()  # b"" once the gateway closes its side
        worker_saw_close.set()

    async with ScriptedServer(handler) as server, worker_transport(max_connections=1) as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        pushed = Pushed()
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await wait_for(lambda: pushed.data == [b"data:1"])
        push.stop()  # as ChunkStream.pump's finally does when its task is cancelled
        await response.aclose()
        await asyncio.wait_for(worker_saw_close.wait(), 5)
        assert not pushed.ended.is_set()
        assert (await fetch(transport, server.url, timeout=1.0)).content == b"hello"
    assert server.connections == 2  # the half-read connection was closed, not reused


async def test_a_push_stopped_by_its_receiver_leaves_the_rest_to_a_read() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:1\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        await answer_every_request(reader, writer, 0)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        pushed = Pushed(stop_after=1)
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await wait_for(lambda: bool(pushed.data))
        read = body_reader(response)
        rest = b""
        while chunk := await asyncio.wait_for(read(), 5):
            rest += chunk
        assert pushed.data == [b"data:1"] and rest == b"data:2"
        assert not pushed.ended.is_set()  # a stopped push says nothing more
        push.stop()
        await response.aclose()


@pytest.mark.parametrize("hooked_late", [False, True], ids=["hooked-early", "hooked-late"])
async def test_bytes_pushed_before_the_connection_was_lost_come_before_the_error(hooked_late: bool) -> None:
    async with ScriptedServer(last_word_then_gone) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        pushed = Pushed()
        if hooked_late:  # the chunk and the failure both arrived before the push began
            content = response.stream._response.content  # type: ignore[attr-defined]
            await wait_for(lambda: content.exception() is not None)
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await asyncio.wait_for(pushed.ended.wait(), 5)
        assert b"".join(pushed.data) == b"last word"
        assert isinstance(pushed.error, httpx.TransportError)
        assert "127.0.0.1" not in str(pushed.error)  # never the worker's address
        push.stop()
        await response.aclose()


async def test_another_transports_body_is_not_pushed() -> None:
    response = httpx.Response(200, content=b"data:1")
    assert push_body(response, Pushed().on_data, Pushed().on_end) is None


async def test_a_pushed_body_keeps_nothing_it_delivered() -> None:
    """Every chunk is its own feed; none may be kept once delivered. (Reading inside the push used
    to re-enter aiohttp's C parser, which then never released the buffer it was parsing: a
    stream's every byte stayed in memory.)"""
    part, parts = b"x" * 2000, 5000  # 10 MB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(parts):
            writer.write(chunk(part))
            await writer.drain()
            if i % 10 == 0:
                await asyncio.sleep(0)  # many separate reads on the gateway's side
        writer.write(LAST_CHUNK)
        await answer_every_request(reader, writer, 0)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        pushed = Pushed(keep=False)
        tracemalloc.start()
        try:
            push = push_body(response, pushed.on_data, pushed.on_end)
            assert push is not None
            await asyncio.wait_for(pushed.ended.wait(), 30)
            gc.collect()
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        push.stop()
        await response.aclose()
    assert pushed.received == len(part) * parts and pushed.error is None
    assert held < 1_000_000, f"{held} bytes still held after relaying {pushed.received}"


async def test_a_push_begun_after_the_reader_filled_up_gets_the_whole_body() -> None:
    """Bytes that arrived before the push filled aiohttp's reader past its high-water mark, so it
    stopped reading from the socket: the push must start it again (it used to stall there until
    the stream's deadline)."""
    part, parts = b"y" * 4000, 200  # 800 KB: past the reader's high-water mark (2 x READ_BUFSIZE)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(parts):
            writer.write(chunk(part))
        writer.write(LAST_CHUNK)
        await writer.drain()
        await answer_every_request(reader, writer, 0)

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        content = response.stream._response.content  # type: ignore[attr-defined]
        await wait_for(lambda: content._protocol._reading_paused)  # nobody read: aiohttp stopped
        pushed = Pushed(keep=False)
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await asyncio.wait_for(pushed.ended.wait(), 5)
        push.stop()
        await response.aclose()
    assert pushed.received == len(part) * parts and pushed.error is None
