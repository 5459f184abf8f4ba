"""TensorRT-LLM's `disaggregated_params` (see `workers.protocols.trtllm` for the gateway's side)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..config import SimConfig
from ..errors import SimError
from ..schema import DisaggParams, optional_int, optional_str
from ..wire import context_only_completion
from .base import ContextIssue, Dialect


def _bad(message: str) -> SimError:
    return SimError(400, message, param="disaggregated_params")


class TrtllmDialect(Dialect):
    name: ClassVar[str] = "trtllm"

    def parse(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], config: SimConfig
    ) -> DisaggParams | None:
        raw = payload.get("disaggregated_params")
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise _bad("disaggregated_params must be an object")
        request_type = raw.get("request_type")
        if request_type in (None, "context_and_generation"):
            return None
        if request_type not in ("context_only", "generation_only"):
            raise _bad(f"unknown request_type {request_type!r}")
        endpoint = raw.get("ctx_info_endpoint")
        if isinstance(endpoint, list):  # TensorRT-LLM sometimes carries a list; the first one counts
            endpoint = endpoint[0] if endpoint else None
        state = optional_str(raw.get("encoded_opaque_state"))
        return DisaggParams(
            request_type=request_type,
            disagg_request_id=optional_int(raw.get("disagg_request_id"), "disagg_request_id"),
            ctx_request_id=optional_int(raw.get("ctx_request_id"), "ctx_request_id"),
            encoded_opaque_state=state,
            kv_source_url=optional_str(endpoint),
            schedule_style=optional_str(raw.get("schedule_style")),
            rendezvous=state is None,
        )

    def context_id_of(self, payload: Any) -> int | None:
        if not isinstance(payload, Mapping):
            return None
        params = payload.get("disaggregated_params")
        if not isinstance(params, Mapping) or params.get("request_type") != "context_only":
            return None
        value = params.get("disagg_request_id", params.get("ctx_request_id"))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def context_answer(self, issue: ContextIssue) -> bytes:
        return context_only_completion(
            issue.config.model,
            prompt_token_ids=issue.prompt_token_ids,
            disaggregated_params={
                "request_type": "context_only",
                "first_gen_tokens": issue.first_gen_tokens,
                "ctx_request_id": issue.handoff_id,
                "disagg_request_id": issue.handoff_id,
                "encoded_opaque_state": issue.encoded_opaque_state,
                "ctx_info_endpoint": issue.public_url,
            },
        )
