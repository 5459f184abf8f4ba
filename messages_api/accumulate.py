"""Fold one stream's Anthropic events into the non-streamed Message.

The non-streaming path runs the same `StreamReframer` and folds its events here, so both
answers come from one code path and cannot drift apart (the SDKs' stream
accumulators do the same fold on their side).

Empty content stays `[]`, as the real API returns it and as the SDKs' own accumulators produce
from the same events; `anthropic.types.Message` accepts it. (TensorRT-LLM answers one empty
text block instead, which the real API would reject if the client sent it back.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jiter
import orjson

from messages_api.errors import AnthropicError, ApiInternalError, from_error_event

__all__ = ["accumulate_message"]

def accumulate_message(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The Message the events describe; an `error` event is raised as its `AnthropicError`."""
    message: dict[str, Any] | None = None
    blocks: list[dict[str, Any]] = []
    # Text per block, joined once at the end: `+=` on a dict value copies the whole string
    # every time, which is quadratic over a long answer.
    pieces: list[list[str]] = []
    stopped = False
    try:
        for event in events:
            kind = event["type"]
            if kind == "error":
                raise from_error_event(event)
            if kind == "ping":
                continue
            if message is None:
                if kind != "message_start":
                    raise _malformed(f"{kind} before message_start")
                message = _skeleton(event["message"])
            elif kind == "content_block_delta":
                pieces[event["index"]].append(_delta_text(event["delta"]))
            elif kind == "content_block_start":
                if event["index"] != len(blocks):
                    raise _malformed("content block indices are not contiguous")
                blocks.append(_block(event["content_block"]))
                pieces.append([])
            elif kind == "message_delta":
                message["stop_reason"] = event["delta"]["stop_reason"]
                message["stop_sequence"] = event["delta"].get("stop_sequence")
                # Cumulative counts: overwrite, as the SDKs do.
                message["usage"].update(event.get("usage") or {})
            elif kind == "message_stop":
                stopped = True
            elif kind == "message_start":
                raise _malformed("a second message_start")
    except (KeyError, IndexError, TypeError) as exc:
        raise _malformed(f"unreadable event ({exc!r})") from exc
    if message is None or not stopped:
        raise ApiInternalError("The response ended before the message was complete")
    # Cut short by max_tokens or a content filter: a tool call's arguments may be incomplete.
    truncated = message["stop_reason"] in ("max_tokens", "refusal")
    for block, parts in zip(blocks, pieces, strict=True):
        _finish_block(block, "".join(parts), truncated)
    message["content"] = blocks
    return message


def _skeleton(start: dict[str, Any]) -> dict[str, Any]:
    usage = start.get("usage") or {}
    return {
        "id": start["id"],
        "type": "message",
        "role": "assistant",
        "model": start["model"],
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.get("input_tokens", 0),
            "output_tokens": usage.get("output_tokens", 0),
            "cache_creation_input_tokens": usage.get("cache_creation_input_tokens") or 0,
            "cache_read_input_tokens": usage.get("cache_read_input_tokens") or 0,
        },
    }


def _block(start: dict[str, Any]) -> dict[str, Any]:
    kind = start["type"]
    if kind == "text":
        return {"type": "text", "text": ""}
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": start.get("signature") or ""}
    if kind == "tool_use":
        return {"type": "tool_use", "id": start["id"], "name": start["name"], "input": {}}
    return dict(start)


def _delta_text(delta: dict[str, Any]) -> str:
    kind = delta["type"]
    text: str
    if kind == "text_delta":
        text = delta["text"]
    elif kind == "thinking_delta":
        text = delta["thinking"]
    elif kind == "input_json_delta":
        text = delta["partial_json"]
    else:
        text = ""  # signature/citations deltas carry no text the reframer produces
    return text


def _finish_block(block: dict[str, Any], text: str, truncated: bool) -> None:
    kind = block["type"]
    if kind == "text":
        block["text"] = text
    elif kind == "thinking":
        block["thinking"] = text
    elif kind == "tool_use" and text.strip():
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            # Cut off by max_tokens: keep what parses, as the SDKs' stream accumulators do.
            value = _partial_json(text) if truncated else None
        if not isinstance(value, dict):
            raise ApiInternalError("The worker returned tool call arguments that are not a JSON object")
        block["input"] = value


def _malformed(what: str) -> AnthropicError:
    return ApiInternalError(f"Malformed response stream: {what}")


def _partial_json(text: str) -> Any:
    try:
        return jiter.from_json(text.encode(), partial_mode="trailing-strings")
    except ValueError:
        return {}
