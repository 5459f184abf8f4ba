"""A generation worker that misbehaves on cue: it answers every chat request with a 200, a fixed
list of raw SSE bytes, then either hangs (keeps the connection open, silent) or closes it.

A real socket server in a thread, so the gateway's own worker client and transport talk to it
exactly as to a real worker. It records whether the gateway hung up on it, which is how a test sees
that a broken stream's worker request was abandoned rather than left open.

    with ScriptedWorker([chunk({"content": "Hi"}), b"data: 5\\n\\n"]) as worker:
        ...  # register worker.url as a generation endpoint and send a request
        worker.wait_for_hang_up()
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Literal

HEALTH_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n"


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
    """One well-formed OpenAI chat.completion.chunk frame."""
    body = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "model": "fake",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ScriptedWorker:
    def __init__(self, frames: list[bytes], *, then: Literal["hang", "close"] = "hang") -> None:
        self.frames = frames
        self.then = then
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self.chat_requests = 0
        self.hung_up = 0  # chat connections the gateway closed while this worker held them open
        self._threads: list[threading.Thread] = []

    def start(self) -> ScriptedWorker:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> ScriptedWorker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait_for_hang_up(self, count: int = 1, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.hung_up < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway did not close the worker connection ({self.hung_up} of {count})")
            time.sleep(0.02)

    # --- the server ------------------------------------------------------------------------------

    def _accept(self) -> None:
        # A blocked accept() does not return when another thread closes the socket (Linux): wait in
        # short slices so that stop() is seen at once instead of after join's 5 s.
        self._listener.settimeout(0.1)
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.1)
            request = self._read_request(conn)
            if request is None:
                return
            if request.startswith(b"GET "):
                conn.sendall(HEALTH_ANSWER)
                return
            with self._lock:
                self.chat_requests += 1
            conn.sendall(STREAM_HEAD + b"".join(self.frames))
            if self.then == "close":
                return
            while not self._stopped.is_set():
                try:
                    if conn.recv(65536) == b"":
                        with self._lock:
                            self.hung_up += 1
                        return
                except TimeoutError:
                    continue
                except OSError:
                    with self._lock:
                        self.hung_up += 1
                    return

    def _read_request(self, conn: socket.socket) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            if self._stopped.is_set():
                return None
            try:
                piece = conn.recv(65536)
            except TimeoutError:
                continue
            if not piece:
                return None
            data += piece
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            try:
                piece = conn.recv(65536)
            except TimeoutError:
                continue
            if not piece:
                return None
            body += piece
        return head
