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
# vLLM's per-choice tail of a chunk that does not finish the stream (its null `token_ids` is
# there unless the request asked for `return_token_ids`).
_OPEN_CHOICE = b',"logprobs":null,"finish_reason":null,"token_ids":null}]'
# Only the role chunk opens the stream with the prompt fields (null unless asked for).
_ROLE_CHOICE = b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
_PROMPT_FIELDS = b',"prompt_token_ids":null,"prompt_text":null'
# vLLM's is "vllm-<version>-<hash of its config>"; the sim's names the sim.
SYSTEM_FINGERPRINT = "sim-" + os.urandom(4).hex()
_FINGERPRINT = b',"system_fingerprint":"%s"' % SYSTEM_FINGERPRINT.encode()


def completion_id() -> str:
    return "chatcmpl-" + os.urandom(12).hex()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """A non-streamed answer's usage, the way vLLM writes it: details null, unless the worker
    reports prefix-cache hits (`cached_tokens`, as vLLM does with --enable-prompt-tokens-details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
        "completion_tokens_details": None,
    }


def _usage_bytes(prompt_tokens: int, completion_tokens: int, *, per_chunk: bool, cached_tokens: int | None = None) -> bytes:
    # vLLM's continuous_usage_stats carry a null completion_tokens_details; the final usage
    # chunk has only the three counts (plus the cache hits where the worker reports them).
    return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d%s%s}' % (
        prompt_tokens,
        prompt_tokens + completion_tokens,
        completion_tokens,
        b"" if cached_tokens is None else b',"prompt_tokens_details":{"cached_tokens":%d}' % cached_tokens,
        b',"completion_tokens_details":null' if per_chunk else b"",
    )


class ChunkFramer:
    """Builds the `data: {chat.completion.chunk}\\n\\n` frames of one stream, in vLLM's shape:

    a role chunk (which alone carries the null prompt fields), one chunk per token with null
    `logprobs`/`token_ids`, the last token's chunk carrying `finish_reason`/`stop_reason`, and,
    when asked for, a usage chunk with `choices: []`. `system_fingerprint` rides on the last
    chunk sent (the usage chunk when there is one).
    """

    __slots__ = ("_head", "_prompt_tokens", "_continuous", "_cached_tokens", "_prompt_fields")

    def __init__(
        self, model: str, prompt_tokens: int, *, continuous_usage: bool, cached_tokens: int | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self._head = (
            b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,"choices":'
            % (completion_id().encode(), int(time.time()), orjson.dumps(model))
        )
        self._prompt_tokens = prompt_tokens
        self._continuous = continuous_usage
        self._cached_tokens = cached_tokens
        self._prompt_fields = (
            _PROMPT_FIELDS if prompt_token_ids is None else b',"prompt_token_ids":' + orjson.dumps(prompt_token_ids) + b',"prompt_text":null'
        )

    def _usage(self, completion_tokens: int) -> bytes:
        # vLLM's continuous_usage_stats: every chunk carries the running usage.
        if self._continuous:
            return b',"usage":' + _usage_bytes(self._prompt_tokens, completion_tokens, per_chunk=True, cached_tokens=self._cached_tokens)
        return b""

    def delta(self, delta: bytes, completion_tokens: int) -> bytes:
        """A frame carrying one token's delta; `completion_tokens` counts it."""
        return b"".join(
            (self._head, b'[{"index":0,"delta":', delta, _OPEN_CHOICE, self._usage(completion_tokens), b"}\n\n")
        )

    def role(self) -> bytes:
        return b"".join((self._head, _ROLE_CHOICE, self._usage(0), self._prompt_fields, b"}\n\n"))

    def finish(
        self,
        delta: bytes | None,
        finish_reason: str,
        stop_reason: str | None,
        completion_tokens: int,
        *,
        last: bool,
    ) -> bytes:
        """The frame that ends the choice: the last token's `delta` (an empty content delta when
        nothing was generated) with the finish reason; `last` when no usage chunk follows."""
        tail = orjson.dumps({"finish_reason": finish_reason, "stop_reason": stop_reason, "token_ids": None})
        return b"".join(
            (
                self._head, b'[{"index":0,"delta":', delta if delta is not None else b'{"content":""}',
                b',"logprobs":null,', tail[1:], b"]", self._usage(completion_tokens),
                _FINGERPRINT if last else b"", b"}\n\n",
            )
        )  # fmt: skip

    def usage(self, completion_tokens: int) -> bytes:
        return b"".join(
            (
                self._head, b'[],"usage":',
                _usage_bytes(self._prompt_tokens, completion_tokens, per_chunk=False, cached_tokens=self._cached_tokens),
                _FINGERPRINT, b"}\n\n",
            )
        )  # fmt: skip


def chat_completion(model: str, generation: Generation, prompt_tokens: int, cached_tokens: int | None = None) -> bytes:
    """A non-streamed chat.completion body, with the null fields vLLM always sends."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": generation.message(),
        "logprobs": None,
        "finish_reason": generation.finish_reason,
        "stop_reason": generation.stop_reason,
        "token_ids": None,
        "routed_experts": None,
    }
    return orjson.dumps(
        {
            "id": completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(prompt_tokens, generation.completion_tokens, cached_tokens),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


def prefill_completion(model: str, *, choice: dict[str, Any], body: dict[str, Any]) -> bytes:
    """A context (prefill) worker's answer, in any dialect: no text, the one token the prefill
    generated, then the dialect's own `choice` fields (its finish reason, its handoff) and `body`
    fields (usage, prompt ids, a top-level handoff), in the order given."""
    return orjson.dumps(
        {
            "id": completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, **choice}],
            **body,
        }
    )
