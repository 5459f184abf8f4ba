"""messages_api/server/direct_write.py: bytes go straight to the socket when nothing is queued, and
through Twisted's queue (in order) otherwise."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet import abstract, tcp

from messages_api.server import direct_write
from messages_api.server.direct_write import DirectWriteServer
from tests.support.reactor import RecordingReactor


@pytest.fixture
def pair() -> Iterator[tuple[DirectWriteServer, socket.socket, RecordingReactor]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.settimeout(2)
    reactor = RecordingReactor()
    # A transport as tcp.Port builds one for an accepted connection (no protocol needed to write).
    transport = DirectWriteServer(ours, None, ("127.0.0.1", 1), None, 1, reactor)  # type: ignore[arg-type]
    yield transport, theirs, reactor
    ours.close()
    theirs.close()


def received(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += sock.recv(size - len(data))
    return data


def test_an_idle_connection_sends_at_once_without_registering_for_writability(pair: Any) -> None:
    transport, client, reactor = pair
    transport.write(b"event: ping\n\n")
    transport.writeSequence([b"5\r\n", b"hello", b"\r\n"])
    assert received(client, 23) == b"event: ping\n\n5\r\nhello\r\n"
    assert reactor.writers == [] and transport._tempDataLen == 0


def test_queued_bytes_are_never_overtaken(pair: Any) -> None:
    transport, client, reactor = pair
    # Something already waits in Twisted's queue: later writes queue behind it.
    abstract.FileDescriptor.write(transport, b"first ")
    transport.write(b"second")
    transport.writeSequence([b" third"])
    assert reactor.writers == [transport]
    client.settimeout(0.2)
    with pytest.raises(TimeoutError):
        client.recv(100)
    transport.doWrite()
    client.settimeout(2)
    assert received(client, 18) == b"first second third"


def test_what_the_kernel_does_not_take_is_queued_in_order(pair: Any) -> None:
    transport, client, reactor = pair
    transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = bytes(range(256)) * 4096  # 1 MiB: more than the socket buffer and SEND_LIMIT
    transport.write(big[:100_000])
    transport.write(big[100_000:])
    assert reactor.writers == [transport]  # the rest waits for writability
    got = b""
    while len(got) < len(big):
        transport.doWrite()
        try:
            got += client.recv(1 << 20)
        except TimeoutError:
            pass
    assert got == big


def test_a_closed_peer_falls_back_to_twisted_which_reports_the_loss(pair: Any) -> None:
    transport, client, reactor = pair
    client.close()
    transport.write(b"x" * 10)  # may be taken by the kernel before the reset is known
    transport.write(b"y" * 10)
    transport.write(b"z" * 10)
    if reactor.writers:  # queued after an error: doWrite reports the loss as Twisted always did
        assert isinstance(transport.doWrite(), BaseException)


def test_install_makes_accepted_connections_direct_writers() -> None:
    previous = tcp.Port.transport
    try:
        direct_write.install()
        assert tcp.Port.transport is DirectWriteServer
    finally:
        tcp.Port.transport = previous  # type: ignore[misc]


def test_the_overridden_methods_are_the_ones_twisted_defines() -> None:
    # That every Twisted name used still exists: tests/unit/disagg_project/test_relied_on.py.
    assert "write" in vars(abstract.FileDescriptor) and "writeSequence" in vars(abstract.FileDescriptor)


def test_what_is_written_while_held_goes_out_in_one_send(pair: Any) -> None:
    transport, client, reactor = pair
    sends: list[bytes] = []
    real = transport.socket

    class Counting:
        def send(self, data: bytes) -> int:
            sends.append(bytes(data))
            sent: int = real.send(data)
            return sent

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    transport.socket = Counting()
    transport.hold()  # daphne answering one message (GuardedRequest.handle_reply)
    transport.writeSequence([b"HTTP/1.1 200 OK\r\n", b"\r\n"])  # HTTPChannel.writeHeaders
    transport.writeSequence([b"5\r\n", b"hello", b"\r\n"])  # Request.write, chunked
    transport.write(b"0\r\n\r\n")  # Request.finish
    assert sends == []
    transport.release()
    transport.write(b"after")  # not held: at once
    assert sends == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\n", b"after"]
    assert received(client, sum(map(len, sends))) == b"".join(sends)


def test_held_bytes_go_out_before_the_connection_is_closed(pair: Any) -> None:
    transport, client, reactor = pair
    transport.hold()
    transport.writeSequence([b"HTTP/1.1 200 OK\r\n\r\n"])
    transport.loseConnection()
    transport.release()
    assert received(client, 19) == b"HTTP/1.1 200 OK\r\n\r\n"
