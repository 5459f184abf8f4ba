"""workers.wire.connection: a chunked answer's body is decoded by the gateway's own decoder (its
head, and every other body, by aiohttp's parser), against real TCP servers scripted byte by byte.
What the relay needs of it: the body intact however the worker's writes split it, pushed or read,
the connection back in the pool after a body read to its end, and never reused after a broken one.
The push and keep-alive behaviour both paths share is tested in tests/unit/workers/wire/test_transport.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp.client_proto import ResponseHandler

from tests.support.chunked import LAST_CHUNK, chunk, chunked
from tests.support.scripted import ScriptedServer, read_request
from tests.support.worker_transport import Pushed, fetch, ok, wait_for, worker_transport
from workers.wire.connection import RelayedBodyParser, WorkerResponseHandler
from workers.wire.push import push_body

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BODY = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
CHUNKED_BODY = chunked(BODY)


def serve_in_pieces(answer: bytes, cuts: list[int], then_answer_more: bool = True):  # type: ignore[no-untyped-def]
    """A handler writing `answer` split at `cuts`, each piece its own write and TCP segment."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number > 1:
            writer.write(ok())
        else:
            start = 0
            for cut in [*cuts, len(answer)]:
                writer.write(answer[start:cut])
                await writer.drain()
                await asyncio.sleep(0.01)  # separate reads on the gateway's side
                start = cut
        if then_answer_more:
            while await read_request(reader):
                writer.write(ok())
                await writer.drain()

    return handler


def parser_of(response: httpx.Response) -> object:
    return response.stream._response.content._protocol._parser  # type: ignore[attr-defined]


async def read_all(response: httpx.Response) -> bytes:
    return b"".join([chunk async for chunk in response.aiter_raw()])


async def test_worker_connections_run_the_worker_protocol_and_a_chunked_body_is_decoded_by_it() -> None:
    rest = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + CHUNKED_BODY[:20])
        await rest.wait()
        writer.write(CHUNKED_BODY[20:])
        while await read_request(reader):
            writer.write(ok())

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        content = response.stream._response.content  # type: ignore[attr-defined]
        assert isinstance(content._protocol, WorkerResponseHandler) and isinstance(content._protocol, ResponseHandler)
        parser = parser_of(response)
        assert isinstance(parser, RelayedBodyParser) and parser.decoding is content
        rest.set()
        assert await read_all(response) == b"".join(BODY)
        assert parser.decoding is None  # done with it
        # A Content-Length answer on the same connection: aiohttp's parser reads its body.
        second = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        second_parser = parser_of(second)
        assert isinstance(second_parser, RelayedBodyParser) and second_parser.decoding is None
        assert await read_all(second) == b"hello"
    assert server.connections == 1


@pytest.mark.parametrize(
    "cuts",
    [
        [len(CHUNKED_HEAD) - 2],  # inside the head's blank line
        [len(CHUNKED_HEAD) - 3, len(CHUNKED_HEAD) - 1],  # the blank line in three reads
        [10, len(CHUNKED_HEAD) + 1],  # the head in two, a size line cut
        [len(CHUNKED_HEAD) + 5, len(CHUNKED_HEAD) + 6, len(CHUNKED_HEAD) + 20],  # chunk data and CRLF cut
        list(range(1, len(CHUNKED_HEAD + CHUNKED_BODY), 7)),
    ],
)
async def test_a_pushed_body_is_intact_however_the_worker_writes_split_it(cuts: list[int]) -> None:
    async with ScriptedServer(serve_in_pieces(CHUNKED_HEAD + CHUNKED_BODY, cuts)) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        pushed = Pushed()
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await asyncio.wait_for(pushed.ended.wait(), 5)
        assert pushed.error is None and b"".join(pushed.data) == b"".join(BODY)
        push.stop()
        await response.aclose()
        assert (await fetch(transport, server.url)).content == b"hello"
    assert server.connections == 1  # read to its end: back to the pool


async def test_an_informational_head_before_the_answer_is_passed_over() -> None:
    rest = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + CHUNKED_HEAD + CHUNKED_BODY[:20])
        await rest.wait()
        writer.write(CHUNKED_BODY[20:])

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        assert response.status_code == 200
        parser = parser_of(response)
        assert isinstance(parser, RelayedBodyParser)
        assert parser.decoding is response.stream._response.content  # type: ignore[attr-defined]  # the answer's body is ours
        rest.set()
        assert await read_all(response) == b"".join(BODY)


@pytest.mark.parametrize("pushed", [True, False], ids=["pushed", "read"])
async def test_malformed_framing_fails_the_body_and_the_connection_is_not_reused(pushed: bool) -> None:
    broken = CHUNKED_HEAD + b"b\r\ndata: one\n\n\r\nzz\r\nnonsense"
    async with ScriptedServer(serve_in_pieces(broken, [len(CHUNKED_HEAD) + 18])) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        if pushed:
            receiver = Pushed()
            push = push_body(response, receiver.on_data, receiver.on_end)
            assert push is not None
            await asyncio.wait_for(receiver.ended.wait(), 5)
            assert receiver.data == [b"data: one\n\n"]
            assert isinstance(receiver.error, httpx.RemoteProtocolError)
            await response.aclose()
        else:
            received = b""
            with pytest.raises(httpx.TransportError):
                async for chunk in response.aiter_raw():
                    received += chunk
            assert received == b"data: one\n\n"
        assert (await fetch(transport, server.url)).content == b"hello"
    assert server.connections == 2  # the broken connection was closed, not reused


async def test_bytes_after_the_end_of_a_body_complete_it_but_close_the_connection() -> None:
    async with ScriptedServer(serve_in_pieces(CHUNKED_HEAD + CHUNKED_BODY + b"HTTP/1.1 200", [])) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        assert await read_all(response) == b"".join(BODY)
        await response.aclose()
        assert (await fetch(transport, server.url)).content == b"hello"
    assert server.connections == 2


async def test_a_connection_lost_mid_chunk_fails_the_push_after_the_bytes_that_came() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + b"b\r\ndata: one\n\n\r\n20\r\npart of a ch")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async with ScriptedServer(handler) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        pushed = Pushed()
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await asyncio.wait_for(pushed.ended.wait(), 5)
        assert b"".join(pushed.data) == b"data: one\n\npart of a ch"
        assert isinstance(pushed.error, httpx.RemoteProtocolError)
        await response.aclose()


async def test_a_push_that_wants_no_more_is_over_and_the_rest_goes_to_the_reader() -> None:
    async with ScriptedServer(serve_in_pieces(CHUNKED_HEAD + CHUNKED_BODY, [len(CHUNKED_HEAD) + 16])) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        pushed = Pushed(stop_after=1)
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await wait_for(lambda: bool(pushed.data))
        assert push.done()  # over at once, as when the reader's waiter is pushed to
        rest = await read_all(response)
        assert b"".join(pushed.data) + rest == b"".join(BODY)
        assert not pushed.ended.is_set()
        assert (await fetch(transport, server.url)).content == b"hello"
    assert server.connections == 1


def paced_body(reads: int, gap_s: float):  # type: ignore[no-untyped-def]
    """A handler answering with a chunked head, then one chunk per `gap_s` for `reads` reads, then
    the end."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        for i in range(reads):
            await asyncio.sleep(gap_s)
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
        writer.write(LAST_CHUNK)

    return handler


async def test_a_decoded_body_bypasses_aiohttps_receive_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no read timeout, a body's bytes go from the connection straight to the decoder: not
    through aiohttp's `ResponseHandler.data_received` (which would only feed the parser)."""
    through_aiohttp: list[bytes] = []
    original = ResponseHandler.data_received

    def counting(self: ResponseHandler, data: bytes) -> None:
        through_aiohttp.append(data)
        original(self, data)

    monkeypatch.setattr(ResponseHandler, "data_received", counting)
    async with ScriptedServer(paced_body(5, 0.01)) as server, worker_transport() as transport:
        response = await transport.handle_async_request(httpx.Request("POST", server.url, content=b"{}"))
        head_reads = len(through_aiohttp)
        assert head_reads >= 1
        pushed = Pushed()
        push = push_body(response, pushed.on_data, pushed.on_end)
        assert push is not None
        await asyncio.wait_for(pushed.ended.wait(), 5)
        assert b"".join(pushed.data) == b"".join(b"data: %d\n\n" % i for i in range(5))
        assert len(through_aiohttp) == head_reads  # five reads of the body, none through aiohttp


async def test_a_read_timeout_is_restarted_by_every_read_of_a_decoded_body() -> None:
    """With a read timeout (`sock_read`), every read restarts it, as aiohttp's own receive path
    does: a body whose reads come closer together than the timeout completes, however long it
    takes in all; a gap longer than the timeout fails it."""
    timeout = {"connect": 5.0, "read": 0.5, "write": 5.0, "pool": 5.0}
    async with ScriptedServer(paced_body(16, 0.05)) as server, worker_transport() as transport:
        request = httpx.Request("POST", server.url, content=b"{}", extensions={"timeout": timeout})
        response = await transport.handle_async_request(request)
        assert isinstance(parser_of(response), RelayedBodyParser)
        # 0.8 s in all, longer than the timeout; each gap far shorter (room for a busy machine).
        assert await read_all(response) == b"".join(b"data: %d\n\n" % i for i in range(16))

    async with ScriptedServer(paced_body(2, 1.5)) as server, worker_transport() as transport:
        request = httpx.Request("POST", server.url, content=b"{}", extensions={"timeout": timeout})
        response = await transport.handle_async_request(request)
        with pytest.raises(httpx.ReadTimeout):
            await read_all(response)
