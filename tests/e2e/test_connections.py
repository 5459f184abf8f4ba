"""Connections that send nothing (messages_api/server/http_guard.py, GuardedHTTPFactory), against real
daphne processes: they are closed after GATEWAY_IDLE_CONNECTION_TIMEOUT_S, a client address past
GATEWAY_MAX_CONNECTIONS_PER_ADDRESS has its next ones closed at accept, and thousands held open
do not slow a client from another address (the whole of 127/8 is loopback on Linux)."""

from __future__ import annotations

import resource
import select
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.conversation import Conversation
from tests.support.gateway import Gateway

pytestmark = pytest.mark.django_db(transaction=True)

CAP = 500
HOLDERS = ("127.0.0.1", "127.0.0.3", "127.0.0.4", "127.0.0.5")  # 4 × 500 = 2,000 idle sockets held
PAST_CAP = 20  # more per holder, each closed at accept


def raise_open_files(needed: int) -> None:
    """This process's descriptor limit (the gateway started after inherits it) up to `needed`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"{needed} open files needed, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def idle_sockets(port: int, source: str, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def closed_by_server(sockets: list[socket.socket], within: float) -> tuple[list[socket.socket], list[socket.socket]]:
    """(closed, still open) after waiting up to `within` seconds for the server to close each."""
    pending = {sock.fileno(): sock for sock in sockets}
    closed: list[socket.socket] = []
    poller = select.epoll()
    for fd in pending:
        poller.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
    deadline = time.monotonic() + within
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(0.0, deadline - time.monotonic())):
            sock = pending.pop(fd, None)
            if sock is None:
                continue
            poller.unregister(fd)
            try:
                data = sock.recv(1)
            except (BlockingIOError, ConnectionResetError):
                data = b""
            assert data == b"", "an idle connection got data"
            closed.append(sock)
    poller.close()
    return closed, list(pending.values())


def timed_request(port: int, source: str, key: str) -> float:
    conversation = Conversation(port, source=source)
    try:
        conversation.send(f"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nx-api-key: {key}\r\n\r\n".encode())
        answer = conversation.answer(wait_close=0)
    finally:
        conversation.close()
    assert answer.status == 200
    return answer.at


def test_idle_connections_are_closed_after_the_timeout(gateways: Callable[..., Gateway]) -> None:
    gateway = gateways(GATEWAY_IDLE_CONNECTION_TIMEOUT_S="1")
    started = time.monotonic()
    sockets = idle_sockets(gateway.port, "127.0.0.1", 200)
    try:
        closed, still_open = closed_by_server(sockets, within=6.0)
        assert still_open == [] and len(closed) == 200  # Twisted's own idle timeout was 60 s
        assert time.monotonic() - started >= 0.9
    finally:
        for sock in sockets:
            sock.close()


def test_an_address_past_its_cap_is_refused_and_others_are_served_promptly(gateways: Callable[..., Gateway], transactional_db: Any) -> None:
    from messages_api.auth import create_api_key

    raise_open_files(len(HOLDERS) * (CAP + PAST_CAP) + 1000)
    gateway = gateways(GATEWAY_MAX_CONNECTIONS_PER_ADDRESS=str(CAP), GATEWAY_IDLE_CONNECTION_TIMEOUT_S="120")
    _, key = create_api_key("connections-other-address")
    timed_request(gateway.port, "127.0.0.2", key)  # the key cached, the process warm
    held: list[socket.socket] = []
    refused: list[socket.socket] = []
    try:
        for holder in HOLDERS:
            held += idle_sockets(gateway.port, holder, CAP)
            refused += idle_sockets(gateway.port, holder, PAST_CAP)
        # Each connection past its address's cap is closed as soon as it is accepted...
        closed, open_past_cap = closed_by_server(refused, within=5.0)
        assert open_past_cap == [] and len(closed) == len(HOLDERS) * PAST_CAP
        # ...and the 2,000 within it stay open.
        closed, open_held = closed_by_server(held, within=0.5)
        assert closed == [] and len(open_held) == len(HOLDERS) * CAP
        # A client of another address is served at once (the median of five: the machine is shared).
        times = [timed_request(gateway.port, "127.0.0.2", key) for _ in range(5)]
        print(f"\n{len(held)} idle sockets held; GET /v1/models from 127.0.0.2: {[round(t * 1000, 1) for t in times]} ms")
        assert statistics.median(times) < 0.1, times
        # A held socket is a live connection, served when it speaks.
        held[0].setblocking(True)
        held[0].settimeout(10)
        held[0].sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        assert held[0].recv(100).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held + refused:
            sock.close()
    # Closed connections give their address its slots back.
    deadline = time.monotonic() + 5
    while True:
        try:
            timed_request(gateway.port, "127.0.0.1", key)
            break
        except (AssertionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
