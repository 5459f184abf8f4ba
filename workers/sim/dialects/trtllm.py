"""TensorRT-LLM's `disaggregated_params` (see `workers.protocols.trtllm` for the gateway's side),
enforced as NVIDIA/TensorRT-LLM main's worker enforces it (`tensorrt_llm/serve/disagg_auth.py`):

- a request whose `disaggregated_params` carries `ctx_info_endpoint` or `encoded_opaque_state`
  must be signed (`x-trtllm-disagg-auth: sha256=<hex HMAC-SHA256>` over the canonical JSON of
  those two fields) when the worker has a key (`SimConfig.internal_request_auth_key`); a missing or
  wrong signature is answered 400 "Invalid internal disaggregated request authentication". A worker
  without a key accepts it unsigned (upstream warns that this will be enforced);
- `ctx_info_endpoint` is the context server's cache-transceiver address, as its `GET /server_info`
  reports it, never an HTTP URL. The sim's address is `tcp://HOST:PORT` of its own HTTP port: the
  dialect translates it back to the HTTP base URL the shared `KvPuller` takes the KV from;
- a `context_only` request must carry `disagg_request_id`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ..config import SimConfig
from ..engine_metrics import MetricNames
from ..error_answers import SimError
from ..schema import DisaggParams, encode_token_ids_b64, optional_int, optional_str
from ..wire import prefill_completion
from .base import ContextIssue, Dialect

AUTH_HEADER = "x-trtllm-disagg-auth"
TRANSCEIVER_SCHEME = "tcp"
AUTH_REJECTED = "Invalid internal disaggregated request authentication"


def _bad(message: str) -> SimError:
    return SimError(400, message, param="disaggregated_params")


def transceiver_address(public_url: str) -> str:
    """The sim's stand-in for a cache-transceiver endpoint: its own host and port, not HTTP."""
    parts = urlsplit(public_url)
    return f"{TRANSCEIVER_SCHEME}://{parts.netloc}"


def kv_source_url(endpoint: str) -> str | None:
    """The HTTP base URL behind a sim transceiver address (None: not one of ours)."""
    parts = urlsplit(endpoint)
    if parts.scheme != TRANSCEIVER_SCHEME or not parts.netloc:
        return None
    return f"http://{parts.netloc}"


def _first(endpoint: Any) -> Any:
    if isinstance(endpoint, list):
        return endpoint[0] if endpoint else None
    return endpoint


def expected_signature(key: str, raw: Mapping[str, Any]) -> str:
    payload = {"ctx_info_endpoint": _first(raw.get("ctx_info_endpoint")), "encoded_opaque_state": raw.get("encoded_opaque_state")}
    message = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return "sha256=" + hmac.new(key.encode("utf-8"), message, hashlib.sha256).hexdigest()


def check_signature(raw: Mapping[str, Any], headers: Mapping[str, str], key: str) -> None:
    """upstream's `validate_internal_disagg_request`, answered as its server answers a ValueError."""
    if raw.get("ctx_info_endpoint") is None and raw.get("encoded_opaque_state") is None:
        return
    if not key:
        return  # upstream: a FutureWarning, and the request is served
    provided = headers.get(AUTH_HEADER)
    if provided is None or not hmac.compare_digest(provided.encode("utf-8", "replace"), expected_signature(key, raw).encode()):
        raise SimError(400, AUTH_REJECTED)


class TrtllmDialect(Dialect):
    name: ClassVar[str] = "trtllm"
    # tensorrt_llm/metrics/collector.py, mounted at /prometheus/metrics by trtllm-serve.
    metrics: ClassVar[MetricNames | None] = MetricNames(
        "/prometheus/metrics", "trtllm_num_requests_waiting", "trtllm_num_requests_running", "trtllm_kv_cache_utilization",
        (("engine_type", "trtllm"),),
    )

    def parse(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], config: SimConfig
    ) -> DisaggParams | None:
        raw = payload.get("disaggregated_params")
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise _bad("disaggregated_params must be an object")
        # Checked before anything else is read, as upstream's server does.
        check_signature(raw, headers, config.internal_request_auth_key)
        request_type = raw.get("request_type")
        if request_type in (None, "context_and_generation"):
            return None
        if request_type not in ("context_only", "generation_only"):
            raise _bad(f"unknown request_type {request_type!r}")
        disagg_request_id = optional_int(raw.get("disagg_request_id"), "disagg_request_id")
        if request_type == "context_only" and disagg_request_id is None:
            raise _bad("context_only request carries no disagg_request_id")
        endpoint = _first(raw.get("ctx_info_endpoint"))
        if endpoint is not None and not isinstance(endpoint, str):
            raise _bad("ctx_info_endpoint must be a string")
        if endpoint and urlsplit(endpoint).scheme in ("http", "https"):
            raise _bad(
                "ctx_info_endpoint must be the context server's cache transceiver endpoint "
                "(its /server_info disaggregated_params), not an HTTP URL"
            )
        state = optional_str(raw.get("encoded_opaque_state"))
        return DisaggParams(
            request_type=request_type,
            disagg_request_id=disagg_request_id,
            ctx_request_id=optional_int(raw.get("ctx_request_id"), "ctx_request_id"),
            encoded_opaque_state=state,
            kv_source_url=kv_source_url(endpoint) if endpoint else None,
            schedule_style=optional_str(raw.get("schedule_style")),
            rendezvous=state is None,
            prompt_ids_b64=raw.get("return_prompt_token_ids_b64") is True,
        )

    def context_id_of(self, payload: Any) -> int | None:
        if not isinstance(payload, Mapping):
            return None
        params = payload.get("disaggregated_params")
        if not isinstance(params, Mapping) or params.get("request_type") != "context_only":
            return None
        value = params.get("disagg_request_id")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def context_answer(self, issue: ContextIssue) -> bytes:
        prompt_tokens = len(issue.prompt_token_ids)
        handoff = {
            "request_type": "context_only",
            "first_gen_tokens": issue.first_gen_tokens,
            "ctx_request_id": issue.handoff_id,
            "disagg_request_id": issue.handoff_id,
            "encoded_opaque_state": issue.encoded_opaque_state,
            "ctx_dp_rank": 0,
            "ctx_info_endpoint": transceiver_address(issue.public_url),
        }
        return prefill_completion(
            issue.config.model,
            choice={"finish_reason": "length", "disaggregated_params": handoff},
            body={
                # As upstream's worker answers: one form or the other, the unused one null.
                **({"prompt_token_ids": None, "prompt_token_ids_b64": encode_token_ids_b64(issue.prompt_token_ids)}
                   if issue.prompt_ids_b64 else {"prompt_token_ids": issue.prompt_token_ids}),
                # TensorRT-LLM's usage (this is its context answer), not vLLM's.
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 1,
                    "total_tokens": prompt_tokens + 1,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            },
        )

    def server_info(self, config: SimConfig, public_url: str) -> dict[str, Any] | None:
        # What the server's KV cache transceiver reports (`get_disaggregated_params`): its
        # endpoint as a list, and its attention-DP rank (0: one rank, no attention DP).
        return {
            "server_info": {
                "disaggregated_params": {
                    "ctx_dp_rank": 0,
                    "ctx_info_endpoint": [transceiver_address(public_url)],
                }
            }
        }
