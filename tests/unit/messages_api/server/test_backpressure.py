"""messages_api/server/backpressure.py: the producer on daphne's request is paused and resumed by
Twisted's own flow control, bounds the connection's queue, cuts a client that takes nothing, and
leaves the connection as it found it. Run against daphne's real protocol and request, on the
gateway's real transport (DirectWriteServer over a socket pair), so that a Twisted or daphne
upgrade that changes what it relies on fails here."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure

from messages_api.server.backpressure import Backpressure, ClientStalled, unsent_in_kernel
from messages_api.server.body_writer import body_writer
from messages_api.server.direct_write import DirectWriteServer
from tests.support.daphne_request import START, daphne_request, stop
from tests.support.reactor import RecordingReactor

FRAME = b"event: content_block_delta\ndata: " + b"x" * 4000 + b"\n\n"


class Calls:
    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0
        self.stalled: list[ClientStalled] = []

    def pause(self) -> None:
        self.paused += 1

    def resume(self) -> None:
        self.resumed += 1

    def on_stall(self, error: ClientStalled) -> None:
        self.stalled.append(error)


@pytest.fixture
def connection() -> Iterator[tuple[DirectWriteServer, socket.socket, RecordingReactor]]:
    """The gateway's transport for an accepted TCP connection, and its client (a 4 KiB window)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.socket()
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        theirs.connect(listener.getsockname())
        ours, peer = listener.accept()
    ours.setblocking(False)
    reactor = RecordingReactor()
    transport = DirectWriteServer(ours, None, peer, None, 1, reactor)  # type: ignore[arg-type]
    yield transport, theirs, reactor
    ours.close()
    theirs.close()


def drain(client: socket.socket, transport: DirectWriteServer, reactor: RecordingReactor) -> int:
    """The client reads everything; Twisted writes its queue as the reactor would. Bytes read."""
    read = 0
    client.setblocking(False)
    while True:
        try:
            data = client.recv(1 << 20)
        except BlockingIOError:
            if transport not in reactor.writers:
                return read
            transport.doWrite()
            continue
        read += len(data)


async def started(connection: Any, calls: Calls, *, buffer_bytes: int = 16 * 1024, stall_s: float = 0.0) -> Any:
    transport, _, _ = connection
    send, request, _, server = await daphne_request(transport)
    await send(START)
    producer = Backpressure.register(send, calls.pause, calls.resume, calls.on_stall, buffer_bytes=buffer_bytes, stall_s=stall_s)
    assert producer is not None
    return send, request, server, producer


async def test_a_client_that_does_not_read_pauses_the_stream_and_its_reading_resumes_it(connection: Any) -> None:
    transport, client, reactor = connection
    calls = Calls()
    send, request, server, producer = await started(connection, calls)
    try:
        assert IPushProducer.providedBy(producer)
        assert request.producer is producer and request.channel._requestProducer is producer
        assert transport.bufferSize == 16 * 1024
        # The kernel's send buffer capped too (it reports twice what is set: its bookkeeping).
        assert transport.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 16 * 1024
        write = body_writer(send)
        assert write is not None
        # The socket takes what its buffer holds (written directly), then Twisted queues the rest;
        # past bufferSize, Twisted pauses the channel, which pauses the producer.
        written = 0
        while not calls.paused:
            write(FRAME)
            written += len(FRAME)
            assert written < 64 << 20, "never paused"
        queued = len(transport.dataBuffer) - transport.offset + transport._tempDataLen
        assert 16 * 1024 < queued <= 16 * 1024 + len(FRAME) + 16
        assert calls.resumed == 0
        assert producer.held_bytes() >= queued

        # The client reads: once the queue is empty Twisted resumes the producer.
        assert drain(client, transport, reactor) >= written
        assert calls.resumed == 1
    finally:
        producer.close()
        stop(server)


async def test_a_producer_registered_while_the_connection_waits_for_its_client_is_paused_at_once(connection: Any) -> None:
    transport, _, _ = connection
    send, request, _, server = await daphne_request(transport)
    await send(START)
    calls = Calls()
    try:
        request.channel.pauseProducing()  # as Twisted's transport does when its queue is full
        assert request.channel._waitingForTransport
        producer = Backpressure.register(send, calls.pause, calls.resume, calls.on_stall, buffer_bytes=0, stall_s=0)
        assert producer is not None and calls.paused == 1
        request.channel.resumeProducing()
        assert calls.resumed == 1
        producer.close()
    finally:
        stop(server)


async def test_close_unregisters_so_the_next_request_on_the_connection_can_register(connection: Any, caplog: Any) -> None:
    transport, _, _ = connection
    calls = Calls()
    send, request, server, producer = await started(connection, calls, buffer_bytes=300_000)
    try:
        channel = request.channel
        producer.close()
        assert request.producer is None and channel._requestProducer is None
        assert "bufferSize" not in vars(transport) and transport.bufferSize == 64 * 1024
        producer.close()  # idempotent
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        assert "Producer was not unregistered" not in caplog.text
        # Twisted's own check: a producer left registered would make this raise.
        channel.registerProducer(SimpleNamespace(), True)
        channel.unregisterProducer()
        # After close, Twisted's calls reach nothing.
        producer.pauseProducing()
        producer.resumeProducing()
        assert calls.paused == calls.resumed == 0
    finally:
        stop(server)


async def test_twisted_does_not_unregister_a_producer_when_the_response_finishes(connection: Any) -> None:
    """What close() is for: Request.finish leaves the producer registered; its cleanup then logs
    an error and unregisters it itself (relied on: disagg_project/relied_on.py)."""
    transport, _, _ = connection
    send, request, _, server = await daphne_request(transport)
    await send(START)
    logged: list[Any] = []
    request._log = SimpleNamespace(failure=lambda *args, **kwargs: logged.append(args), info=lambda *a, **k: None)
    try:
        request.registerProducer(SimpleNamespace(), True)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        assert logged and "Producer was not unregistered" in str(logged[0][1].value)
    finally:
        stop(server)


async def test_close_after_the_connection_is_lost_clears_the_request(connection: Any) -> None:
    calls = Calls()
    _, request, server, producer = await started(connection, calls)
    try:
        request.connectionLost(Failure(ConnectionError("gone")))
        assert request.channel is None
        producer.stopProducing()
        producer.close()
        assert request.producer is None
    finally:
        stop(server)


async def test_any_other_send_has_no_producer() -> None:
    async def plain_send(message: dict[str, Any]) -> None: ...

    calls = Calls()
    assert Backpressure.register(plain_send, calls.pause, calls.resume, calls.on_stall, buffer_bytes=1, stall_s=1) is None


class FakeTransport:
    """What the stall check reads of a transport, with a queue the test sets."""

    def __init__(self, queued: int) -> None:
        self.dataBuffer = b"x" * queued
        self.offset = 0
        self._tempDataLen = 0
        self.socket = None
        self.aborted = 0

    def abortConnection(self) -> None:
        self.aborted += 1


class StubRequest:
    def __init__(self, transport: FakeTransport) -> None:
        self.channel = SimpleNamespace(transport=transport)
        self.producer: Any = None

    def unregisterProducer(self) -> None:
        self.producer = None


def stub_request(transport: FakeTransport) -> Any:
    return StubRequest(transport)


async def test_a_client_that_takes_nothing_for_the_stall_time_is_cut_and_its_connection_aborted() -> None:
    transport = FakeTransport(300_000)
    calls = Calls()
    request = stub_request(transport)
    producer = Backpressure(request, calls.pause, calls.resume, calls.on_stall, stall_s=0.05)
    request.producer = producer
    producer.pauseProducing()
    producer.pauseProducing()  # Twisted calls it on each write while full: forwarded, one timer
    assert calls.paused == 2
    while not calls.stalled:
        await asyncio.sleep(0.01)
    error = calls.stalled[0]
    assert producer.stalled is error and error.error_type == "timeout_error"
    assert error.message.startswith("The client read nothing of the stream for 0.05 seconds with 300000 bytes waiting")
    assert transport.aborted == 0  # the consumer writes the row first; close() aborts
    producer.close()
    assert transport.aborted == 1 and request.producer is None


async def test_a_client_that_takes_some_is_not_cut_and_resuming_disarms_the_check() -> None:
    transport = FakeTransport(300_000)
    calls = Calls()
    producer = Backpressure(stub_request(transport), calls.pause, calls.resume, calls.on_stall, stall_s=0.05)
    producer.pauseProducing()
    for _ in range(4):  # the client takes a little in each stall period
        await asyncio.sleep(0.03)
        transport.offset += 1000
    producer.resumeProducing()
    await asyncio.sleep(0.1)
    assert not calls.stalled and calls.resumed == 1
    producer.close()
    assert transport.aborted == 0


async def test_no_stall_check_when_it_is_off() -> None:
    transport = FakeTransport(300_000)
    calls = Calls()
    producer = Backpressure(stub_request(transport), calls.pause, calls.resume, calls.on_stall, stall_s=0)
    producer.pauseProducing()
    await asyncio.sleep(0.05)
    assert not calls.stalled and calls.paused == 1
    producer.close()


def test_the_kernels_unsent_bytes_are_read() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(listener.getsockname())
        ours, _ = listener.accept()
        with client, ours:
            assert unsent_in_kernel(ours) == 0
            ours.setblocking(False)
            sent = 0
            try:
                while True:
                    sent += ours.send(b"x" * 65536)
            except BlockingIOError:
                pass
            # What the client's window did not take waits, unacknowledged, in our send queue.
            assert 0 < unsent_in_kernel(ours) <= sent
    assert unsent_in_kernel(ours) == 0  # closed: unknown
    assert unsent_in_kernel(None) == 0
