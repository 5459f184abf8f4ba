"""Loopback ports for a child process that binds its own (vLLM, the Rust routers, a NIXL side
channel), and addresses where nothing listens.

A port from `bind(("127.0.0.1", 0))` comes from the kernel's ephemeral range, the range every
outgoing connection and every other `bind(0)` draws from too. Between the moment the test closes
its probe socket and the moment the child binds the port, something else on the machine can take
it: CI once lost a 7-minute vLLM start that way (vLLM's NIXL handshake listener found its port
taken and the server never became healthy). Ports below that range are only ever taken by someone
who asks for them by number, so `unused_port()` picks there, at random, checks that the port binds
now, and never hands the same one out twice in one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Above the registered services people run on development machines (PostgreSQL 5432, Redis 6379,
#: the gateway's own 8000/8080, ...).
LOWEST = 20000
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _binds(port: int) -> bool:
    # Without SO_REUSEADDR, so a port still in TIME_WAIT from an earlier test counts as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def unused_port() -> int:
    """A loopback port nothing holds now, outside the ephemeral range, not given out before."""
    highest = _ephemeral_start() - 1
    if highest - LOWEST < 1000:  # an unusual range: fall back to the kernel's choice
        return _kernel_port()
    for _ in range(200):
        port = random.randint(LOWEST, highest)
        if port not in _handed_out and _binds(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port between {LOWEST} and {highest}")


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    _handed_out.add(port)
    return port


def refused_url() -> str:
    """`http://127.0.0.1:PORT` where nothing listens: a connection there is refused."""
    return f"http://127.0.0.1:{unused_port()}"
