"""A chat request's tools and messages serialized once, for every use that needs their JSON.

A request's prompt is most of its bytes (a Claude Code turn: ~20k tokens of system prompt, tools
and conversation, 80-190 KB of JSON), and three things need it as JSON: the prefix index keys it
(`workers.routing.prefix_index.Prompt`), the token estimate counts the tools' JSON
(`workers.schedule.prompt_tokens`), and every worker request carries it (the context request and the
generation request each). Serialized once here, the worker bodies embed the same bytes as
`orjson.Fragment`s, which orjson copies instead of serializing the objects again.

Protocols still build their bodies from the chat itself and may read or replace its messages:
`dumps` embeds the rendering only where a body holds the chat's own `tools` or `messages` object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson


class RenderedChat:
    """One chat request (the OpenAI chat body the converter made) with its prompt serialized."""

    __slots__ = ("chat", "messages", "tools", "_fragments", "_estimate")

    def __init__(self, chat: Mapping[str, Any]) -> None:
        dumps = orjson.dumps
        self.chat = chat
        #: The tools as one JSON list (b"[]" when there are none), as they go to the workers.
        self.tools: bytes = dumps(chat.get("tools") or [])
        messages = chat.get("messages")
        #: Each message as JSON, in order, as it goes to the workers.
        self.messages: list[bytes] = [dumps(message) for message in messages] if isinstance(messages, list) else []
        self._fragments: list[orjson.Fragment] | None = None
        self._estimate: int | None = None

    @classmethod
    def prepared(cls, chat: Mapping[str, Any]) -> RenderedChat:
        """Rendered with its prompt estimated: all of a request's CPU work before the workers
        see it, done at once, so a large one can be done off the event loop (`messages_api.intake`)."""
        rendered = cls(chat)
        rendered.estimated_prompt_tokens()
        return rendered

    def estimated_prompt_tokens(self) -> int:
        """The prompt's token count as estimated before any worker tokenized it (computed once)."""
        if self._estimate is None:
            # Imported here: prompt_tokens loads the wire client and the cluster's state, which
            # this leaf module (the router's and the prefix index's import) must not pull in.
            from workers.schedule.prompt_tokens import estimate_prompt_tokens

            self._estimate = estimate_prompt_tokens(self.chat, tools_json=self.tools)  # type: ignore[arg-type]
        return self._estimate

    def dumps(self, body: Mapping[str, Any]) -> bytes:
        """`body` as JSON, as `orjson.dumps(body)` writes it; its tools and messages, where they
        are this chat's own objects, copied from their rendering."""
        chat = self.chat
        tools, messages = chat.get("tools"), chat.get("messages")
        own_tools = tools is not None and body.get("tools") is tools
        own_messages = isinstance(messages, list) and body.get("messages") is messages
        if not (own_tools or own_messages):
            return orjson.dumps(body)
        embedded = dict(body)
        if own_tools:
            embedded["tools"] = orjson.Fragment(self.tools)
        if own_messages:
            if self._fragments is None:
                fragment = orjson.Fragment
                self._fragments = [fragment(part) for part in self.messages]
            embedded["messages"] = self._fragments
        return orjson.dumps(embedded)


__all__ = ["RenderedChat"]
