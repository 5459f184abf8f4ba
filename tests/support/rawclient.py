"""A real TCP client for streamed requests: timestamps every byte it sees and can hang up at any
point, which is what an impatient client or a proxy timing out does.

h11 parses the HTTP/1.1 framing (daphne answers streams with chunked encoding); the SSE parsing is
done here so a test sees exactly the frames on the wire, pings and comments included.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11


@dataclass
class Frame:
    event: str
    data: Any
    at: float  # seconds since the request was sent


def parse_frame(raw: bytes) -> tuple[str, Any] | None:
    """One SSE frame (without its blank line) as (event name, parsed data); None for a comment
    frame. Raises ValueError for bytes that are not UTF-8 or data that is not JSON. Deliberately
    not the gateway's own decoder: the tests must not share the code they check."""
    event, data_lines = "", []
    for line in raw.decode().split("\n"):
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data_lines.append(line[5:].strip())
    if not event and not data_lines:
        return None
    return event, (json.loads("\n".join(data_lines)) if data_lines else None)


@dataclass
class RawStream:
    url: str
    body: bytes
    headers: dict[str, str]
    sock: socket.socket = field(init=False)
    sent_at: float = field(init=False)
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    head_at: float | None = None
    frames: list[Frame] = field(default_factory=list)
    ended: bool = False
    _conn: h11.Connection = field(init=False)
    _buffer: bytes = b""
    # The socket's receive buffer (SO_RCVBUF, set before it connects: the window it offers); the
    # kernel's default if None.
    rcvbuf: int | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if self.rcvbuf is None:
            self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            self.sock.settimeout(30)
            self.sock.connect((parts.hostname, parts.port))
        self._conn = h11.Connection(h11.CLIENT)
        headers = [("host", f"{parts.hostname}:{parts.port}")]
        if not any(k.lower() == "content-length" for k in self.headers):
            headers.append(("content-length", str(len(self.body))))
        headers += list(self.headers.items())
        request = h11.Request(method="POST", target=parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers)
        wire = self._conn.send(request) + self._conn.send(h11.Data(data=self.body))
        if len(self.body) == int(dict((k.lower(), v) for k, v in headers)["content-length"]):
            wire += self._conn.send(h11.EndOfMessage())
        self.sock.sendall(wire)
        self.sent_at = time.monotonic()

    @classmethod
    def post_json(cls, url: str, payload: dict[str, Any], headers: dict[str, str], *, rcvbuf: int | None = None) -> RawStream:
        return cls(url, json.dumps(payload).encode(), {k: v for k, v in headers.items() if k.lower() != "content-length"}, rcvbuf=rcvbuf)

    def elapsed(self) -> float:
        return time.monotonic() - self.sent_at

    def _pump(self, deadline: float) -> bool:
        """Process one h11 event; False when the deadline passed or the stream ended."""
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.sock.settimeout(remaining)
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    return False
                self._conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                self.status = event.status_code
                self.head_at = self.elapsed()
                self.response_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                return True
            if isinstance(event, h11.Data):
                self._buffer += bytes(event.data)
                self._parse_frames()
                return True
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                self.ended = True
                return False
            return True

    def _parse_frames(self) -> None:
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            parsed = parse_frame(raw)
            if parsed is not None:
                self.frames.append(Frame(*parsed, self.elapsed()))

    def read_head(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while self.status is None:
            if not self._pump(deadline):
                raise AssertionError("no response head in time")
        return self.status

    def read_until(self, event: str, timeout: float = 10.0) -> Frame:
        """Read until a frame of `event` type arrives (returns it)."""
        deadline = time.monotonic() + timeout
        seen = len(self.frames)
        while True:
            for frame in self.frames[seen:]:
                if frame.event == event:
                    return frame
            seen = len(self.frames)
            if not self._pump(deadline):
                if self.ended:
                    raise AssertionError(f"stream ended without {event!r}: {[f.event for f in self.frames]}")
                if time.monotonic() >= deadline:
                    raise AssertionError(f"no {event!r} in time: {[f.event for f in self.frames]}")

    def read_all(self, timeout: float = 20.0) -> list[Frame]:
        self.read_head(timeout)
        deadline = time.monotonic() + timeout
        while not self.ended:
            if not self._pump(deadline) and not self.ended and time.monotonic() >= deadline:
                raise AssertionError(f"stream did not end in time: {[f.event for f in self.frames]}")
        return self.frames

    def body_json(self, timeout: float = 10.0) -> Any:
        """For a non-stream answer: the whole body as JSON."""
        self.read_head(timeout)
        deadline = time.monotonic() + timeout
        while not self.ended and self._pump(deadline):
            pass
        return json.loads(self._buffer)

    def events(self) -> list[str]:
        return [f.event for f in self.frames]

    def close(self) -> None:
        """Hang up abruptly (RST when data is unread), as a client that gave up does."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        self.sock.close()
