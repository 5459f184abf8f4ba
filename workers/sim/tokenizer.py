"""The simulated tokenizer: deterministic, about one token per word.

A prompt is rendered to text (a fixed template over messages and tools), then split with
`\\w+|[^\\w\\s]` and each piece hashed to an id below VOCAB_SIZE. Tests make long prompts by
repeating words, and `/tokenize` returns the same count the chat route checks.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from typing import Any

import orjson

VOCAB_SIZE = 50000
_TOKEN = re.compile(r"\w+|[^\w\s]")


def tokenize(text: str) -> list[int]:
    """Token ids of `text`."""
    crc32 = zlib.crc32
    return [crc32(piece.encode()) % VOCAB_SIZE for piece in _TOKEN.findall(text)]


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind in ("image_url", "input_image", "image"):
                pieces.append("<image>")
            else:
                pieces.append(f"<{kind}>")
        return "\n".join(pieces)
    return str(content)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def render_message(message: Mapping[str, Any]) -> str:
    lines = [f"<|{message.get('role', 'user')}|>"]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        lines.append(f"<think>{reasoning}</think>")
    lines.append(_content_text(message.get("content")))
    for call in message.get("tool_calls") or ():
        if isinstance(call, Mapping):
            function = call.get("function") or {}
            lines.append(f"<tool_call>{function.get('name', '')} {function.get('arguments', '')}")
    if message.get("tool_call_id"):
        lines.append(f"<tool_call_id>{message['tool_call_id']}")
    return "\n".join(lines)


def render_prompt(messages: Any, tools: Any = None) -> str:
    """The text the chat template would produce for these messages and tools."""
    lines: list[str] = []
    if isinstance(tools, list):
        lines.extend(f"<|tool|>{_dumps(tool)}" for tool in tools)
    if isinstance(messages, list):
        lines.extend(render_message(m) for m in messages if isinstance(m, Mapping))
    lines.append("<|assistant|>")
    return "\n".join(lines)


def tokenize_chat(messages: Any, tools: Any = None) -> list[int]:
    """Prompt token ids for a chat request."""
    return tokenize(render_prompt(messages, tools))
