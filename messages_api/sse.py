"""Anthropic's server-sent-event framing: `event: <type>` then `data: <json>` and a blank line.

The SDKs dispatch on the `event:` name and TypeScript reads `type` from the JSON, so both are
always present and always equal. orjson never emits a newline,
so the data is always a single line.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["PING_FRAME", "encode_event"]

# Byte-for-byte what the real API sends (note the space after the colon: it is not orjson output).
PING_FRAME: bytes = b'event: ping\ndata: {"type": "ping"}\n\n'


def encode_event(event: dict[str, Any]) -> bytes:
    """One SSE frame for one Anthropic stream event (a dict with a string `type`)."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
