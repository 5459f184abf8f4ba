"""vLLM's prefill/decode protocol (`kv_transfer_params`, as vLLM's KV connectors read it).

What `vllm-router --vllm-pd-disaggregation` (vllm-project/router,
`src/routers/http/vllm_pd_router.rs`) and vLLM's own toy proxy
(`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`) send, sequentially:

1. Prefill: the chat request with `max_tokens=1` (`max_completion_tokens=1` when present),
   `min_tokens=1`, `stream=false`, no `stream_options`, and `kv_transfer_params` asking the
   prefill worker to keep the KV for a remote decode.
2. The prefill worker answers with a top-level `kv_transfer_params` (NixlConnector: where and
   which blocks to pull them from) that is copied verbatim into
3. Decode: the original request, streamed, carrying those params.

Both legs carry the same `X-Request-Id`. The prefill answer is never the answer: the proxies
always decode. vLLM's connectors hand off only a length-capped prefill; one that stopped anyway
(a stop string on its one token) answers `kv_transfer_params: null`, and the routers then send
the decode without params, so the decode worker prefills itself; so does this protocol. A
length-capped prefill without params means its worker has no KV connector: a 502.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from workers.exceptions import MalformedAnswer
from workers.protocols.base import (
    AGGREGATED,
    CONTEXT_FIRST,
    USAGE_ON_EVERY_CHUNK,
    Call,
    ContextPeer,
    Handoff,
    WorkerProtocol,
    answered_request,
    reported_prompt_tokens,
    streamed_request,
)
from workers.protocols.engine_load import LoadMetrics
from workers.wire.error_reading import Wordings, wording

REQUEST_ID_HEADER = "X-Request-Id"

# vLLM's sentences for a request that does not fit (`WorkerProtocol.error_wordings`); older vLLM
# answered in OpenAI's words (workers.protocols.openai).
WORDINGS: Wordings = (
    # Serving's max_tokens check: "This model's maximum context length is 8192 tokens. However,
    # you requested 900 output tokens and your prompt contains at least 7293 input tokens, for a
    # total of at least 8193 tokens. ..."
    wording(
        r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, you requested (?P<output>\d{1,12}) output "
        r"tokens and your prompt contains at least (?P<prompt>\d{1,12}) input tokens"
    ),
    # vLLM 0.32 (a real server, tests/realengine/test_real_vllm.py): "... However, your prompt
    # contains at least 4097 input tokens, which exceeds this limit even without any output
    # tokens. ..." (it counts only to the first token past the window: a lower bound, the best there is).
    wording(
        r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, your prompt contains at least "
        r"(?P<prompt>\d{1,12}) input tokens"
    ),
    # vLLM 0.32 (a real server, tests/realengine/test_real_vllm.py): "max_tokens=5000 cannot be
    # greater than max_model_len=4096. Please request fewer output tokens." Not an over-length
    # prompt: the output asked for is larger than the window whatever the prompt.
    wording(r"max_tokens=(?P<output>\d{1,12}) cannot be greater than max_model_len=(?P<maximum>\d{1,12})", output_only=True),
)


def prefill_kv_transfer_params() -> dict[str, Any]:
    """What the routers put on a prefill request: keep the KV for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the prefill phase handed over (a `Handoff`)."""

    #: The prefill answer's `kv_transfer_params`, relayed to the decode worker as they came;
    #: None when the prefill holds no KV (it stopped on its first token).
    kv_transfer_params: dict[str, Any] | None
    prompt_tokens: int | None

    @property
    def generation_pending(self) -> bool:
        return self.kv_transfer_params is not None

    @property
    def complete_answer(self) -> dict[str, Any] | None:
        return None  # vLLM's proxies always decode

    @property
    def prompt_ids_reader(self) -> Callable[[], list[int]] | None:
        return None  # its prefill answer does not carry them


def prefill_request(chat: dict[str, Any]) -> dict[str, Any]:
    body = answered_request(chat, without=("kv_transfer_params",))
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    # As vllm-router 0.1.17 sends it (seen on the wire; its source only clamps a larger value,
    # which vLLM refuses above max_tokens): min_tokens=1 keeps the one token from being a stop
    # token, so the prefill ends length-capped, the only way vLLM's connectors hand KV off.
    body["min_tokens"] = 1
    body["kv_transfer_params"] = prefill_kv_transfer_params()
    return body


def read_prefill_answer(answer: dict[str, Any]) -> PrefillResult:
    prompt_tokens = reported_prompt_tokens(answer)
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict) and params:
        return PrefillResult(params, prompt_tokens)
    if params is None and _finish_reason(answer) == "stop":
        return PrefillResult(None, prompt_tokens)
    raise MalformedAnswer(
        502,
        "the context worker returned no kv_transfer_params (is it running with a KV connector?)",
        stage="context",
        code="malformed_answer",
    )


def _finish_reason(answer: dict[str, Any]) -> Any:
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("finish_reason")
    return None


def decode_request(chat: dict[str, Any], prefill: PrefillResult) -> dict[str, Any]:
    body = streamed(chat)
    if prefill.kv_transfer_params is not None:
        body["kv_transfer_params"] = prefill.kv_transfer_params
    return body


def streamed(chat: dict[str, Any]) -> dict[str, Any]:
    """The request as a decode (or aggregated) worker streams it."""
    return streamed_request(chat, USAGE_ON_EVERY_CHUNK, without=("kv_transfer_params",))


class VllmProtocol(WorkerProtocol):
    """The functions above behind the `WorkerProtocol` interface."""

    name: ClassVar[str] = "vllm"
    label: ClassVar[str] = "vLLM (kv_transfer_params, prefill then decode)"
    schedules: ClassVar[frozenset[str]] = frozenset({CONTEXT_FIRST, AGGREGATED})
    error_wordings: ClassVar[Wordings] = WORDINGS
    # vLLM (V1 engine) mixes it into the hash of a prompt's first KV block, so every block of a
    # salted prompt differs from the same prompt's under another salt (vllm/v1/core/
    # kv_cache_utils.py `generate_block_hash_extra_keys`); the V0 engine refuses the field (400).
    cache_salt_field: ClassVar[str | None] = "cache_salt"
    # vllm/v1/metrics/loggers.py (PrometheusStatLogger): gauges labelled `model_name` (the served
    # model name) and `engine` (one series per data-parallel engine). `vllm:gpu_cache_usage_perc`
    # is the KV figure's name before vLLM renamed it (kept as deprecated for a while, then gone).
    metrics_path: ClassVar[str | None] = "/metrics"
    load_metrics: ClassVar[LoadMetrics | None] = LoadMetrics(
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    )

    def headers(self, body: dict[str, Any], call: Call) -> dict[str, str]:
        # vLLM names the request after it (and both legs after the same one, as the routers do).
        return {REQUEST_ID_HEADER: call.request_id}

    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return self.salted(_with_token_ids(streamed(chat), call), call)

    def context_request(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, schedule_style: str, context: ContextPeer
    ) -> dict[str, Any]:
        return self.salted(prefill_request(chat), call)

    def read_context_answer(self, answer: dict[str, Any]) -> Handoff:
        return read_prefill_answer(answer)

    def generation_request_after_context(self, chat: dict[str, Any], call: Call, handoff: Handoff) -> dict[str, Any]:
        if not isinstance(handoff, PrefillResult):
            raise TypeError(f"not a vLLM handoff: {type(handoff).__name__}")
        return self.salted(_with_token_ids(decode_request(chat, handoff), call), call)


def _with_token_ids(body: dict[str, Any], call: Call) -> dict[str, Any]:
    # vLLM ≥ 0.10.2: the first streamed chunk then carries the prompt's `prompt_token_ids`.
    if call.return_token_ids:
        body["return_token_ids"] = True
    return body


PROTOCOL = VllmProtocol()
