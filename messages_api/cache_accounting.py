"""How much of a prompt sits before its last `cache_control` breakpoint, for Anthropic's usage
fields: `cache_read_input_tokens` (what the worker served from its prefix cache),
`cache_creation_input_tokens` (the prompt up to the last breakpoint that the worker did not hold:
written to its cache by this request) and `input_tokens` (the rest) add up to the prompt.

Anthropic caches in the order tools → system → messages, up to the last block marked
`cache_control`. The share is measured in bytes of the request: what follows the breakpoint is
serialized (usually the newest turn, small), the rest is the body's length, so the cost does not
grow with a long conversation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson


def cached_prefix_share(request: dict[str, Any], body_size: int) -> float:
    """The fraction (0–1) of the request before and including its last breakpoint; 0 without one."""
    if body_size <= 0:
        return 0.0
    tail = 0
    for group in _in_reverse_cache_order(request):
        if not any(isinstance(item, dict) and item.get("cache_control") for item in group.items):
            tail += len(orjson.dumps(group.whole))  # all of it after the breakpoint, framing included
            continue
        for item in reversed(group.items):
            if isinstance(item, dict) and item.get("cache_control"):
                return max(0.0, 1.0 - tail / body_size)
            tail += len(orjson.dumps(item))
    return 0.0


class _Group:
    """A message, the system prompt or the tools: its blocks, and the whole as it is sent."""

    __slots__ = ("items", "whole")

    def __init__(self, items: list[Any], whole: Any) -> None:
        self.items = items
        self.whole = whole


def _in_reverse_cache_order(request: dict[str, Any]) -> Iterator[_Group]:
    """Messages, the system prompt, then the tools, last first (the order a breakpoint covers)."""
    for message in reversed(request.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        yield _Group(content if isinstance(content, list) else [], message)
    system = request.get("system")
    if system is not None:
        yield _Group(system if isinstance(system, list) else [], system)
    tools = request.get("tools")
    if tools:
        yield _Group(list(tools), tools)


def split_prompt(prompt_tokens: int, cache_read: int, share: float) -> tuple[int, int, int]:
    """(input, cache creation, cache read) for a prompt of `prompt_tokens`; they add up to it."""
    cache_read = min(max(cache_read, 0), prompt_tokens)
    creation = max(0, min(round(share * prompt_tokens), prompt_tokens) - cache_read)
    return prompt_tokens - cache_read - creation, creation, cache_read
