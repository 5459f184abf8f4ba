"""TensorRT-LLM's disaggregated protocol (`disaggregated_params` on OpenAI chat requests).

A context worker answers a non-streamed `context_only` request (`disaggregated_params:
{request_type: "context_only", disagg_request_id, schedule_style}`) with the handoff in its first
choice's `disaggregated_params` (`ctx_request_id` and the transfer state) and, where it tokenized
the prompt, `prompt_token_ids`. A generation worker takes the same chat request, streamed, with
that handoff as `disaggregated_params` and `request_type: "generation_only"`. When the context
phase already finished the answer (any `finish_reason` other than `length`/`not_finished`), it is
the answer and no generation request follows. Generation first sends the generation request
first, carrying `ctx_request_id` (the pairing id) and the context endpoint; the worker waits for
that KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from workers.errors import WorkerError
from workers.protocols.base import AGGREGATED, CONTEXT_FIRST, GENERATION_FIRST, Call, ContextPeer, Handoff, WorkerProtocol

CHAT_PATH = "/v1/chat/completions"
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@dataclass(frozen=True, slots=True)
class ContextResult:
    """What the context phase handed over (a `Handoff`)."""

    disaggregated_params: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    prompt_tokens: int | None
    # The context phase already produced the whole answer (EOS or max_tokens reached on the
    # first token): there is nothing for a generation worker to do.
    complete_response: dict[str, Any] | None

    @property
    def generation_pending(self) -> bool:
        return self.disaggregated_params is not None

    @property
    def complete_answer(self) -> dict[str, Any] | None:
        return self.complete_response


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


class TrtllmProtocol(WorkerProtocol):
    """The functions above behind the `WorkerProtocol` interface.

    They are looked up in this module when called, so a test that replaces one (as
    `tests/test_cancellation.py` does) changes what the pipeline runs.
    """

    name: ClassVar[str] = "trtllm"
    label: ClassVar[str] = "TensorRT-LLM (disaggregated_params)"
    schedules: ClassVar[frozenset[str]] = frozenset({CONTEXT_FIRST, GENERATION_FIRST, AGGREGATED})
    chat_path: ClassVar[str] = CHAT_PATH

    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return streamed(chat)

    def context_request(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, schedule_style: str, context: ContextPeer
    ) -> dict[str, Any]:
        return context_request(chat, pair_id, schedule_style)

    def read_context_answer(self, answer: dict[str, Any]) -> Handoff:
        return read_context_response(answer)

    def generation_request_after_context(self, chat: dict[str, Any], call: Call, handoff: Handoff) -> dict[str, Any]:
        if not isinstance(handoff, ContextResult):
            raise TypeError(f"not a TensorRT-LLM handoff: {type(handoff).__name__}")
        return generation_request_after_context(chat, handoff)

    def generation_request_first(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, context: ContextPeer, schedule_style: str
    ) -> dict[str, Any]:
        return generation_request_first(chat, pair_id, context.url, schedule_style)


PROTOCOL = TrtllmProtocol()
