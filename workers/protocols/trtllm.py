"""TensorRT-LLM's disaggregated protocol (`disaggregated_params` on OpenAI chat requests).

See reference/trtllm_disagg.md §1.2–1.3: a context worker answers a `context_only` request with
the handoff on its choice; a generation worker takes a `generation_only` request carrying it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.errors import WorkerError

CHAT_PATH = "/v1/chat/completions"
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@dataclass(frozen=True, slots=True)
class ContextResult:
    """What the context phase handed over."""

    disaggregated_params: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    prompt_tokens: int | None
    # The context phase already produced the whole answer (EOS or max_tokens reached on the
    # first token): there is nothing for a generation worker to do.
    complete_response: dict[str, Any] | None


def context_request(chat: dict[str, Any], disagg_request_id: int, schedule_style: str) -> dict[str, Any]:
    body = dict(chat)
    body["stream"] = False
    body.pop("stream_options", None)
    body["disaggregated_params"] = {
        "request_type": "context_only",
        "disagg_request_id": disagg_request_id,
        "schedule_style": schedule_style,
    }
    return body


def read_context_response(response: dict[str, Any]) -> ContextResult:
    choices = response.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        raise WorkerError(502, "the context worker returned no choices", stage="context")
    choice = choices[0]
    usage = response.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    params = choice.get("disaggregated_params")
    if choice.get("finish_reason") not in ("length", "not_finished", None):
        return ContextResult(None, None, prompt_tokens, complete_response=response)
    if not isinstance(params, dict) or params.get("ctx_request_id") is None:
        raise WorkerError(502, "the context worker returned no disaggregated handoff", stage="context")
    return ContextResult(params, response.get("prompt_token_ids"), prompt_tokens, complete_response=None)


def generation_request_after_context(chat: dict[str, Any], context: ContextResult) -> dict[str, Any]:
    """Context-first: the generation request carries the handoff the context worker returned."""
    assert context.disaggregated_params is not None
    body = streamed(chat)
    body["disaggregated_params"] = {**context.disaggregated_params, "request_type": "generation_only"}
    if context.prompt_token_ids is not None:
        body["prompt_token_ids"] = context.prompt_token_ids
    return body


def generation_request_first(
    chat: dict[str, Any], disagg_request_id: int, context_url: str, schedule_style: str
) -> dict[str, Any]:
    """Generation-first: the generation worker waits for the KV of `disagg_request_id`."""
    body = streamed(chat)
    body["disaggregated_params"] = {
        "request_type": "generation_only",
        "ctx_request_id": disagg_request_id,
        "disagg_request_id": disagg_request_id,
        "ctx_info_endpoint": context_url,
        "schedule_style": schedule_style,
    }
    return body


def streamed(chat: dict[str, Any]) -> dict[str, Any]:
    """The request as a generation worker streams it (usage on every chunk for message_start)."""
    body = dict(chat)
    body.pop("disaggregated_params", None)
    body["stream"] = True
    body["stream_options"] = STREAM_OPTIONS
    return body
