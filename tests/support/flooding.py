"""A generation worker that floods: it ignores `max_tokens` and writes content as fast as the
gateway reads it (tests of the max_tokens cut and of backpressure).

The prompt orders the flood: "[flood chars=N bytes=M]" asks for content chunks of N characters
each (`flood_text(N)`), M bytes of SSE frames of them in all, then a finish chunk and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import re

from tests.support.fakeworker import HEALTH_ANSWER, chunk
from tests.support.scripted import ScriptedServer, read_request
from tests.support.waiting import poll

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
_ORDER = re.compile(rb"\[flood chars=(\d+) bytes=(\d+)\]")


def flood_prompt(chars: int, total: int) -> str:
    """A prompt ordering a flood of `chars`-character content chunks, `total` bytes of them."""
    return f"go [flood chars={chars} bytes={total}]"


def flood_text(chars: int) -> str:
    """The content of one of the flooding worker's chunks of `chars` characters."""
    return ("tok " * chars)[:chars]


def flood_frame(chars: int) -> bytes:
    """One content chunk's SSE frame as the worker writes it (`sent` counts these bytes)."""
    return chunk({"content": flood_text(chars)})


class FloodingWorker:
    """A generation worker that ignores `max_tokens`: every chat request is answered with content
    chunks (chunked transfer coding, as engines send streams) written as fast as the gateway reads
    them, up to the prompt's byte count, then a finish chunk and `[DONE]`. It records, per
    request, the bytes it wrote and whether the gateway hung up before the end; `sending` is the
    bytes written so far by the request in progress (the last one started)."""

    def __init__(self) -> None:
        self.sent: list[int] = []  # bytes of chunks written, per chat request that ended
        self.hung_up = 0  # chat requests the gateway closed before the flood's end
        self.sending = 0  # bytes written so far by the latest chat request
        self._server = ScriptedServer(self._serve)

    @property
    def url(self) -> str:
        return self._server.url

    def reset(self) -> None:
        self.sent.clear()
        self.hung_up = 0
        self.sending = 0

    def __enter__(self) -> FloodingWorker:
        self._server.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop_thread()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        request = await read_request(reader)
        if request is None:
            return
        if request.method == "GET":
            writer.write(HEALTH_ANSWER)
            return
        order = _ORDER.search(request.body)
        assert order is not None, request.body[:200]
        chars, total = int(order.group(1)), int(order.group(2))
        frame = flood_frame(chars)
        frames = frame * max(1, 65536 // len(frame))  # about 64 KiB per HTTP chunk
        piece = b"%x\r\n%b\r\n" % (len(frames), frames)
        writer.write(CHUNKED_HEAD)
        sent = self.sending = 0
        try:
            while sent < total:
                if reader.at_eof():  # the gateway closed its side
                    raise ConnectionResetError
                writer.write(piece)
                await writer.drain()
                sent += len(frames)
                self.sending = sent
            end = chunk({}, "stop") + b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(end), end))
            await writer.drain()
        except ConnectionError:
            self.hung_up += 1
        finally:
            self.sent.append(sent)

    def wait_for_hang_up(self, count: int = 1, timeout: float = 10) -> None:
        poll(lambda: self.hung_up, lambda closed: closed >= count, timeout=timeout, what="the flooding worker's connections the gateway closed")
