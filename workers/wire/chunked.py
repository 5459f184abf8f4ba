"""An incremental decoder of HTTP/1.1 chunked transfer coding (RFC 9112 section 7.1).

    decoder = ChunkedDecoder()
    payload = decoder.feed(data)    # the body bytes in `data`, as they come
    decoder.done                    # True once the last chunk and its trailer section were read
    decoder.leftover                # bytes that came after the end (none from a sound worker)

Chunk data is handed over as it arrives, not when its chunk is complete, so a token is never held
back; only a size line, a chunk's closing CRLF or the trailer section in progress is buffered,
and each is bounded. `ChunkedFramingError` for anything malformed. Pure: no I/O, no asyncio
(`workers.wire.connection` feeds it a worker connection's bytes).
"""

from __future__ import annotations

import re

# A size line ("1a2b;ext=...") longer than this is refused: workers send no chunk extensions.
MAX_SIZE_LINE_BYTES = 1024
# The trailer section after the last chunk (workers send none) is refused past this.
MAX_TRAILER_BYTES = 16 * 1024
# A size line: up to 15 hex digits (chunks under 2**60 bytes), optional whitespace and
# extensions, CRLF. Stricter than int(..., 16), which takes signs, "0x" and underscores.
_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,15})[ \t]*(?:;[^\r\n]*)?\r\n")

# States: what the decoder expects next.
_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)


class ChunkedFramingError(ValueError):
    """The body's chunked framing is malformed."""


class ChunkedDecoder:
    __slots__ = ("_state", "_remaining", "_pending", "_trailer_bytes", "done", "leftover")

    def __init__(self) -> None:
        self._state = _SIZE
        self._remaining = 0  # bytes of the current chunk's data still to come
        self._pending = b""  # a size line, a chunk's CRLF or the trailer section, in part
        self._trailer_bytes = 0
        # A plain attribute, not a property: the relay reads it after every read.
        self.done = False
        self.leftover = b""

    def feed(self, data: bytes) -> bytes:
        """The payload bytes in `data` (b"" when it carries none). After the end, every byte is
        `leftover`."""
        if self._state == _DATA and len(data) <= self._remaining:
            # A read inside one chunk's data: handed over as it is.
            self._remaining -= len(data)
            if not self._remaining:
                self._state = _DATA_END
            return data
        if self._pending:
            data, self._pending = self._pending + data, b""
        parts: list[bytes] = []
        position, end = 0, len(data)
        while position < end:
            state = self._state
            if state == _SIZE:
                match = _SIZE_LINE.match(data, position)
                if match is None:
                    line_end = data.find(b"\r\n", position, position + MAX_SIZE_LINE_BYTES + 2)
                    if line_end >= 0 or end - position > MAX_SIZE_LINE_BYTES:
                        raise ChunkedFramingError("malformed chunk size line")
                    self._pending = data[position:]  # the line's end is still to come
                    break
                size = int(match.group(1), 16)
                position = match.end()
                if not size:
                    self._state = _TRAILER
                    continue
                if end - position >= size + 2:
                    # The whole chunk is here (a token's read, most often): no state to keep.
                    if data[position + size : position + size + 2] != b"\r\n":
                        raise ChunkedFramingError("chunk data not followed by CRLF")
                    parts.append(data[position : position + size])
                    position += size + 2
                    continue
                self._remaining = size
                self._state = _DATA
            elif state == _DATA:
                take = min(self._remaining, end - position)
                parts.append(data[position : position + take])
                position += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _DATA_END
            elif state == _DATA_END:
                closing = data[position : position + 2]
                if closing == b"\r\n":
                    position += 2
                    self._state = _SIZE
                elif closing == b"\r" and position + 1 == end:
                    self._pending = b"\r"
                    break
                else:
                    raise ChunkedFramingError("chunk data not followed by CRLF")
            elif state == _TRAILER:
                # Trailer fields, each ending in CRLF, then an empty line: skipped, bounded.
                line_end = data.find(b"\r\n", position)
                if self._trailer_bytes + (end if line_end < 0 else line_end + 2) - position > MAX_TRAILER_BYTES:
                    raise ChunkedFramingError("trailer section too long")
                if line_end < 0:
                    self._pending = data[position:]
                    break
                if line_end == position:
                    self._state = _DONE
                    self.done = True
                self._trailer_bytes += line_end + 2 - position
                position = line_end + 2
            else:  # done: whatever follows is not this body's
                self.leftover += data[position:]
                break
        return parts[0] if len(parts) == 1 else b"".join(parts)


__all__ = ["ChunkedDecoder", "ChunkedFramingError"]
