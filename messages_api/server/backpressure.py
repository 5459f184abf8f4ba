"""A client that does not read holds its worker back, not the gateway's memory; one that reads
nothing at all for `MESSAGES_CLIENT_STALL_S` is cut.

Under daphne a stream's frames go straight to the connection's transport (body_writer.py), which
queues what the client's socket does not take. Without a producer nothing stops that queue from
growing by the whole answer while the worker is read at full speed. `Backpressure.register(send,
pause, resume, on_stall)` registers a streaming producer (`IPushProducer`) on daphne's request
behind `send` (`Request.registerProducer`): the request's `HTTPChannel` forwards it the transport's
own flow control. Twisted's transport calls the channel's `pauseProducing` when a write leaves more
than its `bufferSize` bytes queued, and its `resumeProducing` once the queue is empty again; the
channel passes both on to the registered producer, which calls `pause` (the run stops reading its
worker's stream, so the worker's TCP send blocks) and `resume`.

What a stream holds while its client does not read, in the gateway's memory: the transport's queue
up to `MESSAGES_CLIENT_BUFFER_BYTES` (applied as the connection's `bufferSize` while the stream
runs), plus the frames of the one worker read being relayed when the pause came (a read is at most
workers.wire.push's PUSH_READ_BYTES) and a ping per `MESSAGES_PING_INTERVAL_S`. In the kernel: the
connection's send buffer, capped at the same size when the stream starts (SO_SNDBUF; autotuned, it
grows to tcp_wmem's maximum, 4 MB, for a client whose window stays shut, and it stays capped for
the connection's later requests), and the worker connection's receive buffer; the worker's further
bytes wait in the worker.

While paused, a timer checks every `MESSAGES_CLIENT_STALL_S` whether the client took any byte:
the bytes not yet acknowledged by it, in the transport's queue and the kernel's send queue
(SIOCOUTQ), must have gone down. If not, `on_stall()` is called (the consumer cancels the request
and its row says why, as a revoked key's does) and `close()` then aborts the connection: the queue
is dropped at once rather than waiting for a client that does not read.

Twisted's behaviour relied on (checked against Twisted 26.10.0, listed in
disagg_project/relied_on.py):
- a producer registered while the channel is already waiting for its transport
  (`HTTPChannel._waitingForTransport`) is not paused by the channel: `register` pauses it;
- `Request.finish` does not unregister a producer (its `_cleanup` logs an error and then does), so
  `close()` unregisters it before the response's last frame, and on every other way out;
- after the connection is lost, `Request.channel` is None and `Request.unregisterProducer` would
  fail: `close()` then only clears `Request.producer`.

Nothing here runs per token: Twisted calls `pauseProducing` on a write only when its queue is
already over `bufferSize`. Any server but daphne: `register` returns None (the consumer's
SendQueue throttles the stream there).
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer  # type: ignore[import-untyped]  # zope ships no type hints

from messages_api.errors import AnthropicError
from messages_api.server.daphne_request import daphne_request

_UNSENT = struct.Struct("i")


def _nothing() -> None:
    pass


class ClientStalled(AnthropicError):
    """The client read nothing of its stream for `seconds` while the gateway held its buffer full."""

    def __init__(self, seconds: float, held: int) -> None:
        super().__init__(
            408,
            f"The client read nothing of the stream for {seconds:g} seconds with {held} bytes waiting: "
            "the stream was cut",
            "timeout_error",
        )


def _cap_kernel_send_buffer(sock: socket.socket | None, size: int) -> None:
    """The kernel's send buffer of `sock` at `size` bytes, not the up to 4 MB its autotuning grows
    to for a client whose window stays shut (the kernel doubles what is set, for its bookkeeping)."""
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, max(size // 2, 2048))
        except OSError:  # closed meanwhile
            pass


def unsent_in_kernel(sock: socket.socket | None) -> int:
    """Bytes in `sock`'s kernel send queue not yet acknowledged by the peer (0 if unknown)."""
    if sock is None:
        return 0
    try:
        unsent: int = _UNSENT.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):  # closed, or not a socket the platform can ask
        return 0
    return unsent


@implementer(IPushProducer)
class Backpressure:
    """The producer of one streamed response on daphne's request (see the module docstring)."""

    __slots__ = (
        "_request", "_transport", "_pause", "_resume", "_on_stall", "_stall_s", "_loop", "_timer",
        "_held", "stalled",
    )

    def __init__(
        self,
        request: Any,
        pause: Callable[[], None],
        resume: Callable[[], None],
        on_stall: Callable[[ClientStalled], None],
        stall_s: float,
    ) -> None:
        self._request: Any = request
        self._transport: Any = request.channel.transport
        self._pause = pause
        self._resume = resume
        self._on_stall = on_stall
        self._stall_s = stall_s
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._held = 0  # bytes the client had not taken when the timer was armed
        #: The client was found stalled: `close()` aborts the connection.
        self.stalled: ClientStalled | None = None

    @classmethod
    def register(
        cls,
        send: Any,
        pause: Callable[[], None],
        resume: Callable[[], None],
        on_stall: Callable[[ClientStalled], None],
        *,
        buffer_bytes: int,
        stall_s: float,
    ) -> Backpressure | None:
        """Pace the response `send` answers by its client: None unless `send` is daphne's and its
        connection is still there. `buffer_bytes` > 0 becomes the transport's `bufferSize` until
        `close()`; `stall_s` <= 0 never cuts a client."""
        request = daphne_request(send)
        if request is None or request.finished or request.channel is None or request.producer is not None:
            return None
        producer = cls(request, pause, resume, on_stall, stall_s)
        if buffer_bytes > 0:
            transport = producer._transport
            transport.bufferSize = buffer_bytes
            _cap_kernel_send_buffer(getattr(transport, "socket", None), buffer_bytes)
        request.registerProducer(producer, True)
        if request.channel._waitingForTransport:
            # Already over its buffer: the channel pauses only producers present when it fills.
            producer.pauseProducing()
        return producer

    # --- IPushProducer: called by Twisted, through the request's HTTPChannel ----------------------

    def pauseProducing(self) -> None:
        # Forwarded each time Twisted calls (each write while the queue is over bufferSize): a
        # pause that came before the run's relay began is otherwise lost, and the run's own pause
        # is idempotent.
        self._pause()
        if self._timer is None and self._stall_s > 0 and self.stalled is None:
            self._held = self.held_bytes()
            self._timer = self._loop.call_later(self._stall_s, self._check)

    def resumeProducing(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self._resume()

    def stopProducing(self) -> None:
        # The connection is gone: daphne tells the consumer, whose request ends and calls close().
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    # --- ours ----------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """The bytes of this connection its client has not taken: in the transport's queue and in
        the kernel's send queue."""
        transport = self._transport
        queued: int = len(transport.dataBuffer) - transport.offset + transport._tempDataLen
        return queued + unsent_in_kernel(getattr(transport, "socket", None))

    def _check(self) -> None:
        self._timer = None
        held = self.held_bytes()
        if held < self._held:  # the client took something: watch on from here
            self._held = held
            self._timer = self._loop.call_later(self._stall_s, self._check)
            return
        self.stalled = ClientStalled(self._stall_s, held)
        self._on_stall(self.stalled)

    def close(self) -> None:
        """The response is over, or about to send its last frame: unregister, give the connection
        its own `bufferSize` back, abort it if its client stalled, and let go of the callables (the
        consumer's and the run's bound methods: held, they would keep the request in a cycle with
        the channel). Idempotent."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        request, self._request = self._request, None
        if request is None:
            return
        self._pause = self._resume = _nothing
        self._on_stall = _ignore_stall
        if request.producer is self:
            if getattr(request, "channel", None) is not None:
                request.unregisterProducer()
            else:  # the connection is lost (or the request cleaned up): its channel is gone
                request.producer = None
        transport = self._transport
        if "bufferSize" in vars(transport):
            del transport.bufferSize  # the class's again (Twisted's 64 KiB) for the next request
        if self.stalled is not None:
            transport.abortConnection()


def _ignore_stall(error: ClientStalled) -> None:
    pass


__all__ = ["Backpressure", "ClientStalled", "unsent_in_kernel"]
