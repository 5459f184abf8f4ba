"""A tokenizer-free estimate of a chat prompt's length.

Used where the gateway must decide before any worker has tokenized the prompt (conditional
disaggregation) and where no worker offers a tokenizer. It counts word and punctuation pieces,
which tracks BPE token counts of English prose and code within a factor of about 1.3.
"""

from __future__ import annotations

import re
from typing import Any

_PIECE = re.compile(r"\w+|[^\w\s]")
# Per-message overhead of chat templates (role markers, separators).
_PER_MESSAGE = 4
# An image costs a roughly fixed number of tokens in vision models.
_PER_IMAGE = 256


def _text_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    total = 0
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                total += _text_tokens(str(part.get("text", "")))
            elif part.get("type") == "image_url":
                total += _PER_IMAGE
    return total


def estimate_prompt_tokens(chat: dict[str, Any]) -> int:
    total = 0
    for message in chat.get("messages") or ():
        total += _PER_MESSAGE + _content_tokens(message.get("content"))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            total += _text_tokens(str(function.get("name", ""))) + _text_tokens(str(function.get("arguments", "")))
        if message.get("reasoning_content"):
            total += _text_tokens(str(message["reasoning_content"]))
    for tool in chat.get("tools") or ():
        total += _text_tokens(str(tool))
    return total
