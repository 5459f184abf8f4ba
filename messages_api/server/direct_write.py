"""Client-bound bytes go to the socket at once when nothing is queued before them.

Twisted's TCP transport never writes in `write()`: it queues the bytes, registers the socket for
writability (an `epoll_ctl`), and sends them on the next loop iteration, then unregisters it (a
second `epoll_ctl`). For a stream whose worker sends one token every 20 ms that is the path of
every SSE frame: two extra system calls and a loop iteration per token, paid for nothing, since
the socket's buffer is almost always empty. `DirectWriteServer` sends at once when the
transport's own queue is empty, and falls back to Twisted's queue for whatever the kernel did not
take (a slow client) or when anything is already queued (so bytes never overtake each other).

While daphne answers one ASGI message (`GuardedRequest.handle_reply`, messages_api/server/http_guard.py)
the connection is held (`hold()`/`release()`): what that message writes goes out in one send at
its end. Twisted writes a response's head (`HTTPChannel.writeHeaders`), then the body or its first
chunk, and `Request.finish` the last chunk's terminator, each on its own; held, a small answer
(head, body, `0\r\n\r\n`) is one send, one TCP segment the client wakes up for. The per-token
frames of a stream (messages_api/server/body_writer.py) are never held.

Installed by `install()` (a hook of disagg_project/daphne.py) as the transport class of every
accepted TCP connection (`tcp.Port.transport`). `GATEWAY_DIRECT_WRITES=0` turns it off. The
Twisted internals it relies on are listed in disagg_project/relied_on.py (tests/unit/disagg_project/test_relied_on.py
checks them). History: bench/results/2026-12-06-daphne-hooks-history.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from twisted.internet import tcp


class DirectWriteServer(tcp.Server):
    """An accepted TCP connection that writes through when its send queue is empty."""

    #: Between `hold()` and `release()`: writes gather in `_held` and go out together.
    _holding = False
    _held = b""

    def write(self, data: bytes) -> None:
        # Runs once per relayed token: the checks and the send are inline, not calls.
        if self._holding:
            self._held += data
            return
        if (
            data
            and self.connected
            and not self.disconnecting
            and not self._writeDisconnected
            and not self._writeDisconnecting
            and not self._tempDataLen
            and self.offset == len(self.dataBuffer)  # nothing queued: a direct send keeps order
            and len(data) <= self.SEND_LIMIT
            and not getattr(self, "TLS", False)
        ):
            try:
                sent = self.socket.send(data)
            except OSError:
                # Full (EAGAIN), interrupted or failing: Twisted's queued write retries it, or
                # meets the same error and closes the connection its usual way.
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        super().write(data)  # type: ignore[no-untyped-call]

    def writeSequence(self, iovec: Iterable[bytes]) -> None:
        self.write(b"".join(iovec))

    def hold(self) -> None:
        """Gather what is written from now until `release()`."""
        self._holding = True

    def release(self) -> None:
        """Send what was gathered since `hold()`, in one piece; later writes go through at once."""
        self._holding = False
        if self._held:
            data, self._held = self._held, b""
            self.write(data)

    def loseConnection(self) -> None:
        self.release()
        super().loseConnection()  # type: ignore[no-untyped-call]

    def loseWriteConnection(self) -> None:
        self.release()
        super().loseWriteConnection()  # type: ignore[no-untyped-call]


def install() -> None:
    """Make every TCP connection daphne accepts from now on a `DirectWriteServer`."""
    tcp.Port.transport = DirectWriteServer
