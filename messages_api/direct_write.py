"""Client-bound bytes go to the socket at once when nothing is queued before them.

Twisted's TCP transport never writes in `write()`: it queues the bytes, registers the socket for
writability (an `epoll_ctl`), and sends them on the next loop iteration, then unregisters it (a
second `epoll_ctl`). For a stream whose worker sends one token every 20 ms that is the path of
every SSE frame: two extra system calls and a loop iteration per token, paid for nothing, since
the socket's buffer is almost always empty. `DirectWriteServer` sends at once when the
transport's own queue is empty, and falls back to Twisted's queue for whatever the kernel did not
take (a slow client) or when anything is already queued (so bytes never overtake each other).

Installed by `install()` (from `disagg_project.asgi`, under daphne) as the transport class of
every accepted TCP connection (`tcp.Port.transport`). `GATEWAY_DIRECT_WRITES=0` turns it off. The
Twisted names it relies on are in `RELIED_ON`; tests/test_direct_write.py checks them.
"""

from __future__ import annotations

from collections.abc import Iterable

from twisted.internet import abstract, tcp

# The Twisted names this module overrides or reads (tests/test_direct_write.py checks them).
RELIED_ON: dict[type, tuple[str, ...]] = {
    tcp.Port: ("transport",),
    tcp.Server: ("write", "writeSequence", "writeSomeData", "SEND_LIMIT"),
    abstract.FileDescriptor: (
        "dataBuffer", "offset", "_tempDataLen", "connected", "disconnecting", "_writeDisconnected",
        "_writeDisconnecting", "producer",
    ),
}


class DirectWriteServer(tcp.Server):
    """An accepted TCP connection that writes through when its send queue is empty."""

    def write(self, data: bytes) -> None:
        if data and self._queue_empty():
            data = self._send_now(data)
            if not data:
                return
        super().write(data)  # type: ignore[no-untyped-call]

    def writeSequence(self, iovec: Iterable[bytes]) -> None:
        if self._queue_empty():
            parts = list(iovec)
            rest = self._send_now(b"".join(parts))
            if rest:
                super().write(rest)  # type: ignore[no-untyped-call]  # Twisted's signature is untyped
            return
        super().writeSequence(iovec)  # type: ignore[no-untyped-call]

    def _queue_empty(self) -> bool:
        """Nothing queued, connection open for writing, no TLS layer: a direct send keeps order."""
        return bool(
            self.connected
            and not self.disconnecting
            and not self._writeDisconnected
            and not self._writeDisconnecting
            and not self._tempDataLen
            and self.offset == len(self.dataBuffer)
            and not getattr(self, "TLS", False)
        )

    def _send_now(self, data: bytes) -> bytes:
        """Send what the kernel takes now; returns the rest for Twisted's queue. An error sends
        nothing and returns everything: the queued write meets the same error and Twisted closes
        the connection its usual way."""
        if len(data) > self.SEND_LIMIT:
            return data
        sent = self.writeSomeData(data)
        if not isinstance(sent, int) or sent <= 0:
            return data
        return data[sent:]


def install() -> None:
    """Make every TCP connection daphne accepts from now on a `DirectWriteServer`."""
    tcp.Port.transport = DirectWriteServer
