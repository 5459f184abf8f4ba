"""OpenAI chat-completion bodies and SSE frames, encoded the way vLLM/TensorRT-LLM send them.

Streaming is the hot path (thousands of streams, tens of thousands of frames a second), so a
stream's constant prefix is encoded once and every frame is a few byte concatenations.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from .output import Generation

DONE_FRAME = b"data: [DONE]\n\n"
_NULL_FINISH = b',"finish_reason":null}]'


def completion_id() -> str:
    return "chatcmpl-" + os.urandom(12).hex()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _usage_bytes(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
    return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,' \
        b'"prompt_tokens_details":{"cached_tokens":%d}}' % (
            prompt_tokens,
            completion_tokens,
            prompt_tokens + completion_tokens,
            cached_tokens,
        )


class ChunkFramer:
    """Builds the `data: {chat.completion.chunk}\\n\\n` frames of one stream."""

    __slots__ = ("_head", "_prompt_tokens", "_continuous", "_cached_tokens")

    def __init__(
        self, model: str, prompt_tokens: int, *, continuous_usage: bool, cached_tokens: int = 0
    ) -> None:
        self._head = (
            b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,"choices":'
            % (completion_id().encode(), int(time.time()), orjson.dumps(model))
        )
        self._prompt_tokens = prompt_tokens
        self._continuous = continuous_usage
        self._cached_tokens = cached_tokens

    def _tail(self, completion_tokens: int) -> bytes:
        # vLLM's continuous_usage_stats: every chunk carries the running usage.
        if self._continuous:
            return b',"usage":' + _usage_bytes(self._prompt_tokens, completion_tokens, self._cached_tokens) + b"}\n\n"
        return b"}\n\n"

    def delta(self, delta: bytes, completion_tokens: int) -> bytes:
        """A frame carrying one token's delta; `completion_tokens` counts it."""
        return b"".join(
            (self._head, b'[{"index":0,"delta":', delta, _NULL_FINISH, self._tail(completion_tokens))
        )

    def role(self) -> bytes:
        return self.delta(b'{"role":"assistant","content":""}', 0)

    def finish(self, finish_reason: str, stop_reason: str | None, completion_tokens: int) -> bytes:
        choice = orjson.dumps(
            [{"index": 0, "delta": {}, "finish_reason": finish_reason, "stop_reason": stop_reason}]
        )
        return b"".join((self._head, choice, self._tail(completion_tokens)))

    def usage(self, completion_tokens: int) -> bytes:
        return b"".join(
            (self._head, b'[],"usage":',
             _usage_bytes(self._prompt_tokens, completion_tokens, self._cached_tokens),
             b"}\n\n")
        )


def chat_completion(
    model: str, generation: Generation, prompt_tokens: int, cached_tokens: int = 0
) -> bytes:
    """A non-streamed chat.completion body."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": generation.message(),
        "finish_reason": generation.finish_reason,
        "stop_reason": generation.stop_reason,
    }
    return orjson.dumps(
        {
            "id": completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage(prompt_tokens, generation.completion_tokens, cached_tokens),
        }
    )


def context_only_completion(
    model: str,
    *,
    prompt_token_ids: list[int],
    disaggregated_params: dict[str, Any],
) -> bytes:
    """A context worker's answer: no text, one first token, and the handoff to pass on."""
    prompt_tokens = len(prompt_token_ids)
    return orjson.dumps(
        {
            "id": completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ""},
                    "finish_reason": "length",
                    "disaggregated_params": disaggregated_params,
                }
            ],
            "prompt_token_ids": prompt_token_ids,
            "usage": usage(prompt_tokens, 1),
        }
    )
