"""Anthropic's server-sent-event framing: `event: <type>` then `data: <json>` and a blank line.

The SDKs dispatch on the `event:` name and TypeScript reads `type` from the JSON, so both are
always present and always equal. orjson never emits a newline,
so the data is always a single line.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["encode_event", "encode_events", "PING_FRAME", "text_delta_frame"]

# Byte-for-byte what the real API sends (note the space after the colon: it is not orjson output).
PING_FRAME: bytes = b'event: ping\ndata: {"type": "ping"}\n\n'


def encode_event(event: dict[str, Any]) -> bytes:
    """One SSE frame for one Anthropic stream event (a dict with a string `type`)."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def encode_events(events: list[dict[str, Any]]) -> bytes:
    """The frames of several events, as one bytes object (one write)."""
    return b"".join(map(encode_event, events))


# `encode_event` of {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta",
# "text": t}}, around the index and the JSON string of the text (tests/unit/workers/wire/test_sse_decoder.py checks
# the two agree).
_TEXT_DELTA_HEAD = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,"delta":{"type":"text_delta","text":'
_TEXT_DELTA_TAIL = b"}}\n\n"


def text_delta_frame(index: int, text: str) -> bytes:
    """The frame of one text delta, without building the event: one per generated token."""
    return (_TEXT_DELTA_HEAD % index) + orjson.dumps(text) + _TEXT_DELTA_TAIL
