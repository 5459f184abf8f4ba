"""What every protocol with a context phase keeps of its context worker's answer, alike: the
prompt's token count only when it is one (the protocols read it with one function,
`workers.protocols.base.reported_prompt_tokens`, where SGLang's refused a negative count and
vLLM's and TensorRT-LLM's kept it)."""

from __future__ import annotations

from typing import Any

import pytest

from workers.protocols import AGGREGATED, PROTOCOLS, WorkerProtocol

# One context answer every engine's reader accepts: TensorRT-LLM's handoff in its first choice,
# vLLM's `kv_transfer_params`, and a length-capped finish (SGLang drops the rest).
ANSWER: dict[str, Any] = {
    "id": "c",
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "x"},
            "finish_reason": "length",
            "disaggregated_params": {"ctx_request_id": 1, "disagg_request_id": 1},
        }
    ],
    "kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [1]},
}

WITH_CONTEXT = [p for p in PROTOCOLS.values() if p.schedules != {AGGREGATED}]


def test_every_engine_with_a_context_phase_is_here() -> None:
    assert {p.name for p in WITH_CONTEXT} == {"trtllm", "vllm", "sglang"}


@pytest.mark.parametrize("protocol", WITH_CONTEXT, ids=lambda p: p.name)
@pytest.mark.parametrize(
    ("usage", "kept"),
    [
        ({"prompt_tokens": 7}, 7),
        ({"prompt_tokens": 0}, 0),
        ({"prompt_tokens": -1}, None),
        ({"prompt_tokens": True}, None),
        ({"prompt_tokens": 7.0}, None),
        ({"prompt_tokens": "7"}, None),
        ({}, None),
        ("7", None),
        (None, None),
    ],
)
def test_a_context_answers_prompt_tokens_are_kept_only_when_a_count(protocol: WorkerProtocol, usage: Any, kept: int | None) -> None:
    answer = {**ANSWER, "usage": usage} if usage is not None else ANSWER
    assert protocol.read_context_answer(answer).prompt_tokens == kept
