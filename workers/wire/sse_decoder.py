"""A pure, incremental Server-Sent Events decoder: bytes in, events out, no I/O.

    decoder = SSEDecoder(max_line_bytes=8 * 1024 * 1024)
    for raw in body_chunks:
        for event in decoder.feed(raw): ...
    for event in decoder.end(): ...      # the stream ended

It follows the WHATWG "event stream interpretation" (html.spec.whatwg.org, server-sent events
§9.2.6): lines end in `\\r\\n`, `\\n` or a bare `\\r` (also when a `\\r\\n` is split across two
feeds); a blank line dispatches the event; `:` starts a comment; fields are `event`, `data`
(several lines joined with `\\n`), `id` (ignored when it holds NUL) and `retry` (digits only); one
leading UTF-8 BOM is dropped; text is UTF-8 with invalid bytes replaced.

Two deliberate departures, both for a gateway reading an untrusted worker:
- a line, or an event's accumulated data, longer than `max_line_bytes` raises `SSELineTooLong`
  instead of being buffered for ever; the check costs nothing per byte, and a huge line is
  scanned once (the search resumes where the last feed stopped), so a 100 MB line without a
  newline is refused in linear time;
- at the end of the stream, an event whose last line was complete but whose blank line never
  came is still dispatched (the spec discards it): some servers close right after
  `data: [DONE]\\n`. An unterminated last line is discarded (it may have been cut).

Why not httpx-sse's decoder (0.4.3, on the index): it decodes text, so it needs an incremental
UTF-8 decoder in front of it, and it buffers a line of any length; bounding it would mean
wrapping both halves. This module is the same state machine over bytes, with the bound inside.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_LINE_END = re.compile(rb"\r\n?|\n")
_BOM = b"\xef\xbb\xbf"


class SSEError(ValueError):
    """The event stream cannot be decoded."""


class SSELineTooLong(SSEError):
    """A line, or one event's data, is longer than the decoder's limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"an event stream line or event is longer than {limit} bytes")
        self.limit = limit


class Event(NamedTuple):
    """One dispatched event. `event` is "message" when the stream named no type.

    A named tuple rather than a frozen dataclass: one is built per relayed token, and it is
    several times cheaper to build."""

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


class SSEDecoder:
    """Turns the bytes of one event stream, fed in any split, into events.

    Not thread-safe; one decoder per stream. After `end()` or an `SSEError`, discard it.
    """

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer already searched for a line end
        self._skip_lf = False  # the last feed ended in "\r": a "\n" starting the next is its pair
        self._at_start = True  # a BOM may still come
        self._line_complete = True  # the last line seen was ended (for end())
        # The event being built.
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._event_type = b""
        self._last_id = ""
        self._retry: int | None = None

    def feed(self, data: bytes) -> list[Event]:
        """Decode `data`; return the events it completed (often none or one)."""
        if not data:
            return []
        if not self._skip_lf and not self._at_start and b"\r" not in data:
            if (
                not self._buffer
                and not self._data
                and not self._event_type
                and data.startswith(b"data:")
                and data.endswith(b"\n\n")
                and data.count(b"\n") == 2
            ):
                # One whole `data:` event per feed, the shape of a token relayed as it is made:
                # decoded here, without `_feed_lf`'s call (this runs per relayed token).
                if len(data) - 2 > self.max_line_bytes:  # the line, as the general path measures it
                    raise SSELineTooLong(self.max_line_bytes)
                self._scanned = 0
                self._line_complete = True
                value = data[6:-2] if data[5:6] == b" " else data[5:-2]
                return [Event(value.decode("utf-8", "replace"), "message", self._last_id, self._retry)]
            return self._feed_lf(data)
        buffer = self._buffer
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == 0x0A:
                data = data[1:]
        buffer += data
        if self._at_start:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                return []  # maybe a BOM cut in two: wait for the rest
            if buffer.startswith(_BOM):
                del buffer[: len(_BOM)]
            self._at_start = False
        events: list[Event] = []
        start = 0
        limit = self.max_line_bytes
        search = _LINE_END.search
        position = self._scanned
        while (match := search(buffer, position)) is not None:
            end = match.start()
            if end - start > limit:
                raise SSELineTooLong(limit)
            if match.end() == len(buffer) and match.group() == b"\r":
                self._skip_lf = True  # "\r" closing a feed: a "\n" may follow in the next one
            event = self._line(bytes(buffer[start:end]))
            if event is not None:
                events.append(event)
            start = position = match.end()
        if start:
            del buffer[:start]
        if len(buffer) > limit:
            raise SSELineTooLong(limit)
        self._scanned = len(buffer)
        self._line_complete = not buffer
        return events

    def _feed_lf(self, data: bytes) -> list[Event]:
        """`feed` for data whose lines all end in "\n" (what workers send): splitting bytes is
        several times cheaper than the general scan. Still linear: buffered bytes are joined
        once, when the line they belong to ends."""
        buffer = self._buffer
        limit = self.max_line_bytes
        if b"\n" not in data:
            buffer += data
            if len(buffer) > limit:
                raise SSELineTooLong(limit)
            self._scanned = len(buffer)
            self._line_complete = False
            return []
        if buffer:
            data = bytes(buffer) + data
            buffer.clear()
        *lines, rest = data.split(b"\n")
        events: list[Event] = []
        for line in lines:
            if len(line) > limit:
                raise SSELineTooLong(limit)
            event = self._line(line)
            if event is not None:
                events.append(event)
        if len(rest) > limit:
            raise SSELineTooLong(limit)
        buffer += rest
        self._scanned = len(rest)
        self._line_complete = not rest
        return events

    def end(self) -> list[Event]:
        """The stream ended: the event still pending, when its last line was complete."""
        events: list[Event] = []
        if self._line_complete and self._data:
            event = self._dispatch()
            if event is not None:
                events.append(event)
        self._buffer.clear()
        self._data = []
        return events

    # --- one line ------------------------------------------------------------------------------

    def _line(self, line: bytes) -> Event | None:
        if not line:
            return self._dispatch()
        if line[0] == 0x3A:  # ":" a comment
            return None
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data_bytes += len(value) + 1
            if self._data_bytes > self.max_line_bytes:
                raise SSELineTooLong(self.max_line_bytes)
            self._data.append(value)
        elif name == b"event":
            self._event_type = value
        elif name == b"id":
            if b"\0" not in value:
                self._last_id = value.decode("utf-8", "replace")
        elif name == b"retry":
            if value.isdigit():
                self._retry = int(value)
        return None  # any other field is ignored, as the spec says

    def _dispatch(self) -> Event | None:
        data, event_type = self._data, self._event_type
        self._data, self._data_bytes, self._event_type = [], 0, b""
        if not data:
            return None
        return Event(
            data=(data[0] if len(data) == 1 else b"\n".join(data)).decode("utf-8", "replace"),
            event=event_type.decode("utf-8", "replace") if event_type else "message",
            id=self._last_id,
            retry=self._retry,
        )


__all__ = ["Event", "SSEDecoder", "SSEError", "SSELineTooLong"]
