"""`[sim key=value ...]` directives: faults and output shapes chosen by the prompt's author.

They are read from the text of the last `user` message only, so a directive quoted earlier in
a conversation (or echoed back in a tool result) does not fire again on every later turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_BRACKET = re.compile(r"\[sim(?:\s+([^\]]*))?\]")


@dataclass(frozen=True, slots=True)
class Directives:
    """The parsed directives; defaults mean "no fault, normal output"."""

    context_delay: float = 0.0
    context_status: int | None = None
    gen_delay: float = 0.0
    gen_status: int | None = None
    gen_fail_after: int | None = None
    tokens: int | None = None
    reasoning: int = 0
    say: str | None = None
    tool_call: str | None = None
    tool_calls: int = 1
    tool_args_invalid: bool = False


NO_DIRECTIVES = Directives()


def _float(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if number >= 0 and number != float("inf") else None


def _int(value: str) -> int | None:
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number >= 0 else None


def _status(value: str) -> int | None:
    number = _int(value)
    return number if number is not None and 400 <= number <= 599 else None


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """All `key=value` pairs from every `[sim ...]` bracket in `text`, in order."""
    pairs: list[tuple[str, str]] = []
    for match in _BRACKET.finditer(text):
        for item in (match.group(1) or "").split():
            key, sep, value = item.partition("=")
            if sep:
                pairs.append((key, value))
    return pairs


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "context_delay": _float,
    "gen_delay": _float,
    "context_status": _status,
    "gen_status": _status,
    "gen_fail_after": _int,
    "tokens": _int,
    "reasoning": _int,
    "tool_calls": _int,
    "say": lambda value: value.replace("_", " "),
    "tool_call": lambda value: value or None,
    "tool_args": lambda value: value == "invalid",
}
_FIELD_FOR = {"tool_args": "tool_args_invalid"}


def parse_text(text: str) -> Directives:
    """Directives from one piece of text; for a key given twice the last valid value wins.

    Unknown keys and malformed values are ignored.
    """
    fields: dict[str, Any] = {}
    for key, raw in parse_pairs(text):
        convert = _CONVERTERS.get(key)
        if convert is not None and (value := convert(raw)) is not None:
            fields[_FIELD_FOR.get(key, key)] = value
    if fields.get("tool_calls") == 0:
        del fields["tool_calls"]
    return Directives(**fields) if fields else NO_DIRECTIVES


def _text_parts(content: Any) -> Iterable[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    yield text


def last_user_text(messages: Any) -> str:
    """The text of the last message whose role is `user` ("" if there is none, or if tool results
    came after it: a turn that only returns tool results carries no new directives, or a
    `tool_call` directive would fire again on every turn)."""
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if not isinstance(message, Mapping):
            continue
        if message.get("role") == "tool":
            return ""
        if message.get("role") == "user":
            return "\n".join(_text_parts(message.get("content")))
    return ""


def parse_messages(messages: Any) -> Directives:
    """Directives for a chat request."""
    text = last_user_text(messages)
    return parse_text(text) if "[sim" in text else NO_DIRECTIVES
