"""Counting a chat prompt's tokens with a worker's own tokenizer, where a worker offers one.

vLLM-compatible servers (and the simulated worker) answer `POST /tokenize` with `{"count": N}`
for a chat request. Without one, the count is `workers.tokens.estimate_prompt_tokens`.
"""

from __future__ import annotations

import logging
from typing import Any

from workers import client
from workers.errors import WorkerError
from workers.health import health
from workers.registry import PoolInfo
from workers.tokens import estimate_prompt_tokens

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 3.0


async def count_prompt_tokens(pool: PoolInfo, chat: dict[str, Any]) -> tuple[int, str]:
    """The prompt's token count and where it came from (`worker` or `estimate`)."""
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
            return count, "worker"
    return estimate_prompt_tokens(chat), "estimate"
