"""A chat prompt's token count: from a worker's own tokenizer where one offers it, else a
tokenizer-free estimate.

vLLM-compatible servers (and the simulated worker) answer `POST /tokenize` with `{"count": N}`
for a chat request. The estimate is used where no worker offers one, and where the gateway must
decide before any worker has seen the prompt (conditional disaggregation). It counts word and
punctuation pieces, which tracks BPE token counts of English prose and code within a factor of
about 1.3.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from workers import client
from workers.errors import WorkerError
from workers.health import health
from workers.registry import PoolInfo

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 3.0

_PIECE = re.compile(r"\w+|[^\w\s]")
# Per-message overhead of chat templates (role markers, separators).
_PER_MESSAGE = 4
# An image costs a roughly fixed number of tokens in vision models.
_PER_IMAGE = 256


async def count_prompt_tokens(pool: PoolInfo, chat: dict[str, Any]) -> int:
    """The prompt's token count by the first usable worker that tokenizes (context workers
    first), else the estimate."""
    body = {"model": chat.get("model"), "messages": chat.get("messages", []), "add_generation_prompt": True}
    if chat.get("tools"):
        body["tools"] = chat["tools"]
    for endpoint in sorted(pool.endpoints, key=lambda e: e.role != "context"):
        if not health.usable(endpoint):
            continue
        try:
            answer = await client.post_json(endpoint.url + "/tokenize", body, stage="tokenize", timeout=TOKENIZE_TIMEOUT_S)
        except WorkerError as exc:
            logger.debug("tokenize on %s failed: %s", endpoint.url, exc.message)
            continue
        count = answer.get("count")
        if isinstance(count, int) and count >= 0:
            return count
    return estimate_prompt_tokens(chat)


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
