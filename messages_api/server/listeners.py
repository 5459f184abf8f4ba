"""The listening sockets of N gateway processes on one port: one each, or one they share.

With one shared socket, whichever process wakes first accepts, and Twisted accepts up to a
hundred connections per wake-up (`twisted.internet.tcp.Port.numberAccepts`, which grows while
there are more). When many connections arrive together (a team starting work, every client
reconnecting after a restart) one process takes most of them, and keep-alive connections stay
where they landed: a 200-stream burst on two processes went 77 % / 23 % (bench/relay.py
--gateway-processes 2, 2026-12-05-reuseport.md), so one loop did three quarters of the work.

With `SO_REUSEPORT` each process has its own socket bound to the same address, and the kernel
spreads new connections over them by a hash of the connection's addresses: even in number,
whenever they arrive. The price: the choice ignores load, so a process stalled for a while still
gets its share of new connections (they wait in its backlog, as they wait for a restarted
process: the supervisor keeps every socket open).
"""

from __future__ import annotations

import socket

__all__ = ["bind_listeners", "reuse_port_supported"]


def reuse_port_supported() -> bool:
    return hasattr(socket, "SO_REUSEPORT")


def bind_listeners(host: str, port: int, count: int, backlog: int) -> list[socket.socket]:
    """`count` listening sockets on `host:port` (0: a free port, the same for all), each with
    `SO_REUSEPORT` when `count` > 1. Raises OSError (every socket closed) if one cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            # The first socket picks the port when asked for any; the others join it.
            sock.bind((host, port if len(sockets) == 1 else sockets[0].getsockname()[1]))
            sock.listen(backlog)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
