"""messages_api/server/listeners.py: the listening sockets of `manage.py serve`'s processes."""

from __future__ import annotations

import socket

import pytest

from messages_api.server.listeners import bind_listeners

pytestmark = pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="needs SO_REUSEPORT")


def test_one_socket_each_on_one_free_port() -> None:
    sockets = bind_listeners("127.0.0.1", 0, 3, 16)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(sockets) == 3 and len(ports) == 1 and ports != {0}
        assert all(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for sock in sockets)
        assert all(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


def test_connections_are_spread_over_the_sockets() -> None:
    sockets = bind_listeners("127.0.0.1", 0, 2, 128)
    port = sockets[0].getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        accepted = []
        for sock in sockets:
            sock.setblocking(False)
            count = 0
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                count += 1
            accepted.append(count)
        # Each connection is in exactly one socket's queue; by the hash of its addresses, each
        # socket holds about half (fewer than 12 of 64 on one side: p < 1e-6).
        assert sum(accepted) == 64
        assert min(accepted) >= 12, accepted
    finally:
        for sock in clients + sockets:
            sock.close()


def test_a_single_socket_is_an_ordinary_one() -> None:
    (sock,) = bind_listeners("127.0.0.1", 0, 1, 16)
    try:
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
    finally:
        sock.close()


def test_a_port_in_use_fails_with_every_socket_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    made: list[socket.socket] = []

    class Recorded(socket.socket):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(socket, "socket", Recorded)
    try:
        with pytest.raises(OSError):
            bind_listeners("127.0.0.1", taken.getsockname()[1], 2, 16)
    finally:
        taken.close()
    assert made and all(sock.fileno() == -1 for sock in made)
