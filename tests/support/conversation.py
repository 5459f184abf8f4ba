"""A raw HTTP/1.1 conversation with a gateway over one TCP connection: bytes written exactly as the
test gives them (on a thread, so the answer is read while still sending), the answer read and
parsed by hand, and whether the server closed the connection after it. For the tests of what the
gateway does before any HTTP library would let a client get there: malformed or oversized heads,
bodies that trickle or never end, refusals at the headers.

`Answer.envelope()` checks an answer is Anthropic's error envelope and returns its `error`."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tests.support.gateway import Gateway

__all__ = ["Answer", "Conversation", "dechunk", "exchange"]


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    at: float  # seconds from connecting to the end of the answer
    closed: bool  # the server closed the connection after it

    def envelope(self) -> dict[str, Any]:
        assert self.headers["content-type"] == "application/json"
        data = json.loads(self.body)
        assert data["type"] == "error"
        assert set(data["error"]) == {"type", "message"}
        assert data["request_id"].startswith("req_")
        assert self.headers["request-id"] == data["request_id"]
        return data["error"]


@dataclass
class Conversation:
    """One TCP connection; writes happen on a thread so the answer is read while still sending."""

    port: int
    host: str = "127.0.0.1"
    source: str | None = None  # the client's own address (any of 127/8 is loopback on Linux)
    sock: socket.socket = field(init=False)
    started: float = field(init=False)
    sent: int = 0
    send_error: BaseException | None = None
    _sender: threading.Thread | None = None

    def __post_init__(self) -> None:
        source = (self.source, 0) if self.source is not None else None
        self.sock = socket.create_connection((self.host, self.port), timeout=15, source_address=source)
        self.started = time.monotonic()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)
        self.sent += len(data)

    def send_in_background(self, parts: Any, pause: float = 0.0) -> None:
        def run() -> None:
            try:
                for part in parts:
                    self.send(part)
                    if pause:
                        time.sleep(pause)  # the client's pace is what is under test
            except OSError as exc:
                self.send_error = exc

        self._sender = threading.Thread(target=run, daemon=True)
        self._sender.start()

    def answer(self, timeout: float = 15.0, *, wait_close: float = 2.0) -> Answer:
        """Read one answer, then wait up to `wait_close` seconds for the server to close."""
        self.sock.settimeout(timeout)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed without an answer: {data!r}"
            data += chunk
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        assert not lines[0].startswith("HTTP/1.1 100"), lines[0]
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if headers.get("transfer-encoding") == "chunked":
            while not rest.endswith(b"\r\n0\r\n\r\n") and rest != b"0\r\n\r\n":
                rest += self._more()
            body = dechunk(rest)
        else:
            length = int(headers["content-length"])
            while len(rest) < length:
                rest += self._more()
            body = rest[:length]
        at = time.monotonic() - self.started
        return Answer(status, headers, body, at, self._closed_after(wait_close))

    def _more(self) -> bytes:
        data = self.sock.recv(65536)
        assert data, "connection closed in the middle of an answer"
        return data

    def _closed_after(self, timeout: float) -> bool:
        if timeout <= 0:
            return False
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()
        if self._sender is not None:
            self._sender.join(5)


def exchange(gateway: Gateway, data: bytes, *, wait_close: float = 2.0) -> Answer:
    conversation = Conversation(gateway.port)
    try:
        conversation.send(data)
        return conversation.answer(wait_close=wait_close)
    finally:
        conversation.close()



def dechunk(data: bytes) -> bytes:
    body = b""
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return body
        body, data = body + data[:size], data[size + 2 :]
