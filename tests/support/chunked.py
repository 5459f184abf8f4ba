"""Chunked transfer coding (RFC 9112 section 7.1) for the tests and benchmarks: writing it
(`chunk`, `chunked`) and reading it (`dechunk` for a whole body, `ChunkedDecoder` for bytes as
they come).

Reading is the product's own decoder, workers.wire.chunked: what uses it here decodes what the
gateway sends, and tests nothing of the decoder. tests/unit/workers/wire/test_chunked.py, which does test that
decoder, checks it against `chunked` below, written independently of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.wire.chunked import ChunkedDecoder, ChunkedFramingError

LAST_CHUNK = b"0\r\n\r\n"


def chunk(data: bytes, extension: bytes = b"") -> bytes:
    """One chunk: the size line (with `extension`, e.g. b";name=value"), the data, CRLF."""
    return b"%x%b\r\n%b\r\n" % (len(data), extension, data)


def chunked(parts: Iterable[bytes], *, extension: bytes = b"", trailer: bytes = b"") -> bytes:
    """A whole chunked body: one chunk per non-empty part, the last chunk, the `trailer` fields
    (each ending in CRLF) and the blank line that ends the body."""
    return b"".join(chunk(part, extension) for part in parts if part) + b"0" + extension + b"\r\n" + trailer + b"\r\n"


def dechunk(data: bytes, *, complete: bool = True) -> bytes:
    """The payload of the chunked body `data` (bytes after its end are ignored).

    ChunkedFramingError when the framing is malformed, and, with `complete`, when the body stops
    before its last chunk; `complete=False` gives what arrived of a body cut short."""
    decoder = ChunkedDecoder()
    payload = decoder.feed(data)
    if complete and not decoder.done:
        raise ChunkedFramingError("the body ends before its last chunk")
    return payload


__all__ = ["LAST_CHUNK", "ChunkedDecoder", "ChunkedFramingError", "chunk", "chunked", "dechunk"]
