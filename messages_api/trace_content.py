"""Opt-in: a traced request's prompt and answer on its span (TRACE_RECORD_CONTENT, off by default),
in OpenTelemetry's GenAI attributes, each a JSON string in the conventions' message schema:

    gen_ai.system_instructions   the request's `system`, as parts
    gen_ai.input.messages        its messages, as [{"role", "parts": [...]}]
    gen_ai.output.messages       the answer, [{"role": "assistant", "parts": [...], "finish_reason"}]

    recorder = recorder_for(record, request)   # None unless on and the request's span is sampled
    sink = recorder.wrap(sink)                  # the relay's chunks pass through it
    recorder.finish(stop_reason)

Bounded: each attribute carries at most TRACE_RECORD_CONTENT_MAX_CHARS characters of content.
The prompt is filled from its last message backwards (the turn being answered matters most), and
the messages that did not fit are counted in `gateway.content.input_messages_omitted`; a text cut
short ends where the budget did; at most MAX_ITEMS messages, and parts of each. Images and documents are named by their type, never their data.
The answer's text and tool calls are collected as they are relayed until the budget is spent; off,
nothing of this runs, and the relay's sink is the consumer's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import orjson
from django.conf import settings

from disagg_project import tracing
from messages_api.audit import AuditRecord

__all__ = ["ContentRecorder", "input_messages", "MAX_ITEMS", "recorder_for", "system_instructions"]

#: At most this many messages, and parts of a message, are recorded (content without text, an
#: image's name, costs no characters but still bytes).
MAX_ITEMS = 100


def recorder_for(record: AuditRecord, request: dict[str, Any]) -> ContentRecorder | None:
    """With TRACE_RECORD_CONTENT on and the request's span sampled: the prompt recorded on the
    current span now, and a recorder for the answer; else None (nothing done)."""
    if not record.trace_id or not settings.TRACE_RECORD_CONTENT:
        return None
    limit = settings.TRACE_RECORD_CONTENT_MAX_CHARS
    messages, omitted = input_messages(request.get("messages") or [], limit)
    attributes: dict[str, Any] = {"gen_ai.input.messages": _json(messages)}
    if omitted:
        attributes["gateway.content.input_messages_omitted"] = omitted
    system = request.get("system")
    if system:
        attributes["gen_ai.system_instructions"] = _json(system_instructions(system, limit))
    tracing.annotate(attributes)
    return ContentRecorder(limit)


class ContentRecorder:
    """The answer's content, collected from the relayed OpenAI chunks up to `limit` characters."""

    __slots__ = ("_left", "_text", "_tools")

    def __init__(self, limit: int) -> None:
        self._left = limit
        self._text: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}  # by the chunk's tool call index

    def wrap(self, sink: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """`sink`, with each chunk taken here first."""

        def recording(chunk: dict[str, Any]) -> None:
            if self._left > 0:
                self.take(chunk)
            sink(chunk)

        return recording

    def take(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            text = delta.get("content")
            if isinstance(text, str) and text:
                self._text.append(self._cut(text))
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    self._take_call(call)

    def _take_call(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        part = self._tools.get(index)
        if part is None:
            part = self._tools[index] = {"type": "tool_call", "id": "", "name": "", "arguments": ""}
        if isinstance(call.get("id"), str):
            part["id"] = call["id"]
        function = call.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                part["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                part["arguments"] += self._cut(function["arguments"])

    def _cut(self, text: str) -> str:
        taken = text[: max(self._left, 0)]
        self._left -= len(text)
        return taken

    def finish(self, stop_reason: str) -> None:
        """Record the answer on the current span (what was relayed of it, if it ended early)."""
        parts: list[dict[str, Any]] = []
        if self._text:
            parts.append({"type": "text", "content": "".join(self._text)})
        parts.extend(self._tools[index] for index in sorted(self._tools))
        message: dict[str, Any] = {"role": "assistant", "parts": parts}
        if stop_reason:
            message["finish_reason"] = stop_reason
        tracing.annotate({"gen_ai.output.messages": _json([message])})


def input_messages(messages: list[dict[str, Any]], limit: int) -> tuple[list[dict[str, Any]], int]:
    """Anthropic `messages` in GenAI's input schema within `limit` characters of content, and how
    many earlier messages were left out."""
    budget = [limit]
    kept: list[dict[str, Any]] = []
    for message in reversed(messages):
        if budget[0] <= 0 or len(kept) >= MAX_ITEMS:
            break
        kept.append({"role": message.get("role", ""), "parts": _parts(message.get("content"), budget)})
    kept.reverse()
    return kept, len(messages) - len(kept)


def system_instructions(system: str | list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    return _parts(system, [limit])


def _parts(content: Any, budget: list[int]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "content": _take(content, budget)}]
    parts: list[dict[str, Any]] = []
    for block in _blocks(content):
        if budget[0] <= 0 or len(parts) >= MAX_ITEMS:
            break
        parts.append(_part(block, budget))
    return parts


def _blocks(content: Any) -> Iterable[dict[str, Any]]:
    return [block for block in content if isinstance(block, dict)] if isinstance(content, list) else ()


def _part(block: dict[str, Any], budget: list[int]) -> dict[str, Any]:
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "content": _take(str(block.get("text", "")), budget)}
    if kind == "thinking":
        return {"type": "reasoning", "content": _take(str(block.get("thinking", "")), budget)}
    if kind in ("tool_use", "server_tool_use"):
        arguments = orjson.dumps(block.get("input", {})).decode()
        return {"type": "tool_call", "id": block.get("id", ""), "name": block.get("name", ""), "arguments": _take(arguments, budget)}
    if kind == "tool_result":
        inner = block.get("content")
        result = inner if isinstance(inner, str) else "".join(str(b.get("text", "")) for b in _blocks(inner) if b.get("type") == "text")
        return {"type": "tool_call_response", "id": block.get("tool_use_id", ""), "result": _take(result, budget)}
    return {"type": str(kind)}  # an image, a document, ...: named, never its data


def _take(text: str, budget: list[int]) -> str:
    taken = text[: max(budget[0], 0)]
    budget[0] -= len(taken)
    return taken


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()
