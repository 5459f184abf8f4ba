"""TensorRT-LLM's disaggregated protocol (`disaggregated_params` on OpenAI chat requests), as
NVIDIA/TensorRT-LLM main's proxy speaks it (`tensorrt_llm/serve/openai_disagg_service.py`,
`openai_protocol.py` class `DisaggregatedParams`, `disagg_auth.py`).

Context first: a non-streamed `context_only` request (`disaggregated_params: {request_type,
disagg_request_id, schedule_style, conversation_id?}`); the context worker answers with the
handoff in its first choice's `disaggregated_params`, the prompt as `prompt_token_ids` (or
`prompt_token_ids_b64`, relayed verbatim) and its `usage`. A context endpoint with the option
`prompt_token_ids_b64: true` is asked for the second form (`return_prompt_token_ids_b64`, what
upstream's proxy asks with its opt-in `gen_tokids_ctxbytes`): one base64 int32 string the gateway
checks with a scan of its characters and relays, instead of ~20,000 ints it must check
(workers.wire.raw_ints). Both roles' servers must know the field: their request models forbid
unknown ones, so an older server answers 400. When the context phase already
finished the answer (a `finish_reason` other than `length`/`not_finished`), that answer is the
answer. Otherwise the generation worker gets the same chat request, streamed, with the handoff as
`disaggregated_params` (`request_type: "generation_only"`, `schedule_style`, `conversation_id`,
`ctx_usage`).

Generation first: the generation request goes out first with `ctx_request_id =
disagg_request_id = pair id`, merged with what the context server reports under
`server_info.disaggregated_params` of its `GET /server_info` (`ctx_info_endpoint`, a list of
cache-transceiver addresses of which the first counts, and `ctx_dp_rank`): never its HTTP URL.

Signed handoffs: a request whose `disaggregated_params` carries `ctx_info_endpoint` or
`encoded_opaque_state` gets `x-trtllm-disagg-auth: sha256=<hex HMAC-SHA256>` over the canonical
JSON of those two fields, keyed with the pool's `handoff_signing_key`. Upstream has no environment
variable for it: the workers read `internal_request_auth_key` from their LLM-API config YAML
(`trtllm-serve --config`), the proxy from its disaggregated-server config (`DisaggServerConfig.
internal_request_auth_key`); the pool's key must equal the workers'. Without a key the request goes unsigned, as upstream's proxy sends
it: a worker without a key accepts it (upstream warns that this will be enforced), one with a key
answers 400 "Invalid internal disaggregated request authentication", which `explain_error` turns
into the gateway's own failure (the client's request was not at fault).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import orjson

from workers.exceptions import MalformedAnswer, WorkerError
from workers.protocols.base import (
    AGGREGATED,
    CONTEXT_FIRST,
    GENERATION_FIRST,
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
from workers.wire import client
from workers.wire.error_reading import Wordings, wording

logger = logging.getLogger(__name__)

SERVER_INFO_PATH = "/server_info"
AUTH_HEADER = "x-trtllm-disagg-auth"
# upstream's `_GEN_PENDING_FINISH_REASONS`: the context worker holds KV for a generation request.
GENERATION_PENDING = frozenset({"length", "not_finished"})
# The fields of `server_info.disaggregated_params` merged into a generation-first request. Upstream
# merges whatever the server reports; a worker is untrusted, so only the fields that describe the
# context side are taken (it must not rename the request or change its type).
PEER_FIELDS = ("ctx_info_endpoint", "ctx_dp_rank", "encoded_opaque_state")
# How long a context endpoint's /server_info is reused: it changes only when the server restarts
# (a new cache-transceiver address), and a stale one fails that request's KV transfer, not others.
SERVER_INFO_TTL_S = 30.0
SERVER_INFO_TIMEOUT_S = 5.0
SERVER_INFO_CACHE_SIZE = 1024
MAX_ENDPOINT_CHARS = 512

# TensorRT-LLM's sentences for a request that does not fit (`WorkerProtocol.error_wordings`).
WORDINGS: Wordings = (
    # Its OpenAI server since PR #19457 (code context_length_exceeded), in OpenAI's newer words:
    # "This model's maximum context length is 69632 tokens. However, your messages resulted in
    # 69666 tokens. Please reduce the length of the messages."
    wording(r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, your messages resulted in (?P<prompt>\d{1,12}) tokens"),
    # Before it, TensorRT backend (llmapi/llm.py `_check_arguments`; the prompt length is printed
    # as a float, prompt_len / cp_size): "The sum of prompt length (4000.0) and query length (0)
    # max_tokens (2048) should not exceed max_seq_len (4096)"
    wording(
        r"The sum of prompt length \((?P<prompt>\d{1,12})(?:\.\d*)?\) and query length \((?P<query>\d{1,12})\) "
        r"max_tokens \((?P<output>\d{1,12})\) should not exceed max_seq_len \((?P<maximum>\d{1,12})\)"
    ),
    # ... PyTorch backend: "The sum of prompt length (50857.0), query length (0) should not
    # exceed max_num_tokens (32768)"
    wording(
        r"The sum of prompt length \((?P<prompt>\d{1,12})(?:\.\d*)?\), query length \((?P<query>\d{1,12})\) "
        r"should not exceed max_num_tokens \((?P<maximum>\d{1,12})\)"
    ),
    # ... and `_deduce_max_tokens` (executor/base_worker.py): "`default_max_tokens` (-40205)
    # should be greater than 0, `default_max_tokens` (-40205) = max_seq_len (40961) -
    # `splited_prompt_len` (81166) - `query_token_len` (0)"
    wording(
        r"`default_max_tokens` \(-?\d+\) = max_seq_len \((?P<maximum>\d{1,12})\) - `splited_prompt_len` "
        r"\((?P<prompt>\d{1,12})\) - `query_token_len` \((?P<query>\d{1,12})\)"
    ),
)


@dataclass(frozen=True, slots=True)
class ContextResult:
    """What the context phase handed over (a `Handoff`)."""

    disaggregated_params: dict[str, Any] | None
    #: As the context worker sent them: a list, or their JSON text (`workers.wire.raw_ints`).
    prompt_token_ids: list[int] | orjson.Fragment | None
    prompt_tokens: int | None
    # The context phase already produced the whole answer (EOS or max_tokens reached on the
    # first token): there is nothing for a generation worker to do.
    complete_response: dict[str, Any] | None
    #: upstream's base64 int32 prompt, relayed as it came (never decoded here).
    prompt_token_ids_b64: str | None = None
    #: The context answer's `usage`, passed on as `ctx_usage` (the generation worker reports it).
    usage: dict[str, Any] | None = None

    @property
    def generation_pending(self) -> bool:
        return self.disaggregated_params is not None

    @property
    def complete_answer(self) -> dict[str, Any] | None:
        return self.complete_response

    @property
    def prompt_ids_reader(self) -> Callable[[], list[int]] | None:
        if self.prompt_token_ids_b64 is not None:
            return partial(_ids_of_b64, self.prompt_token_ids_b64)
        ids = self.prompt_token_ids
        if isinstance(ids, orjson.Fragment):
            return partial(_ids_of_json, ids)
        return None if ids is None else partial(list, ids)


def _ids_of_b64(text: str) -> list[int]:
    """Token ids from upstream's `prompt_token_ids_b64` (little-endian int32s, checked by
    `is_int32_b64` when the answer was read)."""
    ids = array("i", base64.b64decode(text))
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()


def _ids_of_json(text: orjson.Fragment) -> list[int]:
    """Token ids from the JSON text `workers.wire.raw_ints` kept (a compact array of ints)."""
    ids = orjson.loads(orjson.dumps(text))
    return ids if isinstance(ids, list) else []


# --- signatures (disagg_auth.py) -----------------------------------------------------------------


def canonical_auth_payload(disaggregated_params: Mapping[str, Any]) -> bytes:
    """What upstream signs: the protected fields as compact, key-sorted JSON (`json.dumps`, so
    non-ASCII is escaped exactly as the workers escape it); a list endpoint counts by its first."""
    endpoint = disaggregated_params.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    payload = {"ctx_info_endpoint": endpoint, "encoded_opaque_state": disaggregated_params.get("encoded_opaque_state")}
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")


def needs_signature(body: Mapping[str, Any]) -> bool:
    params = body.get("disaggregated_params")
    return isinstance(params, Mapping) and (
        params.get("ctx_info_endpoint") is not None or params.get("encoded_opaque_state") is not None
    )


def sign(signing_key: str, disaggregated_params: Mapping[str, Any]) -> str:
    digest = hmac.new(signing_key.encode("utf-8"), canonical_auth_payload(disaggregated_params), hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def is_auth_rejection(error: WorkerError) -> bool:
    """A worker's refusal of the handoff signature (upstream's ValueError texts, answered 400)."""
    if error.status != 400:
        return False
    text = f"{error.message} {error.detail}".lower()
    return "disaggregated" in text and ("authentication" in text or "authenticated" in text)


# --- the context phase -----------------------------------------------------------------------------


def context_request(
    chat: dict[str, Any],
    disagg_request_id: int,
    schedule_style: str,
    conversation_id: str | None = None,
    ids_as_b64: bool = False,
) -> dict[str, Any]:
    body = answered_request(chat, without=("disaggregated_params",))
    params: dict[str, Any] = {
        "request_type": "context_only",
        "disagg_request_id": disagg_request_id,
        "schedule_style": schedule_style,
    }
    if conversation_id:
        params["conversation_id"] = conversation_id
    # Asked for only where the operator said the workers know it (upstream's proxy: only with its
    # opt-in `gen_tokids_ctxbytes`). A worker that answers with it unasked is relayed all the same.
    if ids_as_b64:
        params["return_prompt_token_ids_b64"] = True
    body["disaggregated_params"] = params
    return body


def _bad_answer(what: str) -> MalformedAnswer:
    return MalformedAnswer(502, f"the context worker's answer {what}", stage="context", code="invalid_handoff")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all_ints(ids: list[Any]) -> bool:
    """Whether every item is an int and none a bool, as `_is_int` on each, at a fraction of its
    cost: over a Claude Code prompt's 20k ids a generator over `_is_int` took 2.3 ms of every
    request, `set(map(type, ids))` 0.37 ms, this 0.15 ms. orjson writes an int (of any int type
    but bool) as digits with an optional minus sign, and anything else with a character of its
    own: `.`/`e` in a float, letters in true/false/null, quotes, brackets inside the outer ones.
    What orjson cannot write at all (an int beyond 64 bits, which orjson.loads never makes) is
    refused: the generation request could not carry it either."""
    try:
        data = orjson.dumps(ids)
    except orjson.JSONEncodeError:
        return False
    return not data[1:-1].translate(None, b"0123456789,-")


#: The context endpoint's option (`register_worker --option prompt_token_ids_b64=true`).
IDS_AS_B64_OPTION = "prompt_token_ids_b64"
_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def is_int32_b64(text: str) -> bool:
    """Whether `text` is padded standard base64 (RFC 4648) of a non-empty whole number of int32s,
    as upstream's context worker writes `prompt_token_ids_b64` and its generation worker reads it.
    A scan of the characters in C, not a decode: `binascii.a2b_base64` took 230 µs over a Claude
    Code prompt's 21k ids, this ~45. A string that passes cannot break out of the JSON string it
    is relayed in (orjson writes it), and decodes to whole int32s."""
    if not text or len(text) % 4 or not text.isascii():
        return False
    data = text.encode("ascii")
    padding = data.translate(None, _B64_ALPHABET)  # what is not base64's own: "=" at the end only
    if padding not in (b"", b"=", b"==") or not data.endswith(padding):
        return False
    return (len(data) // 4 * 3 - len(padding)) % 4 == 0


def read_context_response(response: dict[str, Any]) -> ContextResult:
    """Check the context answer as upstream's `_verify_ctx_response` and `_need_gen` do."""
    choices = response.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        raise WorkerError(502, "the context worker returned no choices", stage="context")
    choice = choices[0]
    usage = response.get("usage")
    usage = usage if isinstance(usage, dict) else None
    prompt_tokens = reported_prompt_tokens(response)
    params = choice.get("disaggregated_params")
    if not isinstance(params, dict):
        raise WorkerError(502, "the context worker returned no disaggregated handoff", stage="context", code="invalid_handoff")
    if choice.get("finish_reason") not in GENERATION_PENDING:
        # Finished in the context phase: the answer, without the handoff (upstream deletes it).
        complete = {**response, "choices": [{k: v for k, v in choice.items() if k != "disaggregated_params"}, *choices[1:]]}
        return ContextResult(None, None, prompt_tokens, complete_response=complete)
    for name in ("ctx_request_id", "disagg_request_id"):
        if not _is_int(params.get(name)):
            raise _bad_answer(f"has no {name} in its disaggregated_params")
    b64 = response.get("prompt_token_ids_b64")
    if b64 is not None and not (isinstance(b64, str) and is_int32_b64(b64)):
        raise _bad_answer("has a prompt_token_ids_b64 that is not a base64 int32 buffer")
    ids = response.get("prompt_token_ids")
    # A Fragment was checked when it was read: a compact array of ints (workers.wire.raw_ints).
    if ids is not None and not isinstance(ids, orjson.Fragment) and not (isinstance(ids, list) and _all_ints(ids)):
        raise _bad_answer("has a prompt_token_ids that is not a list of integers")
    return ContextResult(
        params, None if b64 is not None else ids, prompt_tokens, complete_response=None, prompt_token_ids_b64=b64, usage=usage
    )


def generation_request_after_context(
    chat: dict[str, Any],
    context: ContextResult,
    schedule_style: str = CONTEXT_FIRST,
    conversation_id: str | None = None,
) -> dict[str, Any]:
    """Context-first: the generation request carries the handoff the context worker returned."""
    assert context.disaggregated_params is not None
    body = streamed(chat)
    params = {**context.disaggregated_params, "request_type": "generation_only", "schedule_style": schedule_style}
    if conversation_id:
        params["conversation_id"] = conversation_id
    if context.usage is not None:
        params["ctx_usage"] = context.usage
    body["disaggregated_params"] = params
    if context.prompt_token_ids_b64 is not None:
        body["prompt_token_ids_b64"] = context.prompt_token_ids_b64
    elif context.prompt_token_ids is not None:
        body["prompt_token_ids"] = context.prompt_token_ids
    return body


# --- generation first ------------------------------------------------------------------------------


def peer_params(server_info: Any) -> dict[str, Any]:
    """The context-side fields of a `GET /server_info` answer, checked (a worker is untrusted):
    `ctx_info_endpoint` must be there, a non-empty string or a list whose first one is."""
    if not isinstance(server_info, dict):
        raise MalformedAnswer(502, "the context worker's /server_info is not an object", stage="context")
    info = server_info.get("server_info")
    reported = info.get("disaggregated_params") if isinstance(info, dict) else None
    if not isinstance(reported, dict):
        raise MalformedAnswer(
            502, "the context worker's /server_info reports no disaggregated_params", stage="context", code="no_ctx_info_endpoint"
        )
    endpoint = reported.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    if not isinstance(endpoint, str) or not endpoint or len(endpoint) > MAX_ENDPOINT_CHARS:
        raise MalformedAnswer(
            502, "the context worker's /server_info reports no usable ctx_info_endpoint", stage="context", code="no_ctx_info_endpoint"
        )
    params: dict[str, Any] = {"ctx_info_endpoint": endpoint}
    if _is_int(reported.get("ctx_dp_rank")):
        params["ctx_dp_rank"] = reported["ctx_dp_rank"]
    if isinstance(reported.get("encoded_opaque_state"), str):
        params["encoded_opaque_state"] = reported["encoded_opaque_state"]
    return params


class ServerInfoCache:
    """Each context endpoint's checked `/server_info` fields, reused for `SERVER_INFO_TTL_S` and
    bounded in size; a failed read is not kept (the next request asks again)."""

    def __init__(self, ttl_s: float = SERVER_INFO_TTL_S, size: int = SERVER_INFO_CACHE_SIZE) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._entries: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def get(self, url: str) -> dict[str, Any] | None:
        entry = self._entries.get(url)
        if entry is None:
            return None
        expires_at, params = entry
        if expires_at <= time.monotonic():
            del self._entries[url]
            return None
        return params

    def put(self, url: str, params: dict[str, Any]) -> None:
        self._entries[url] = (time.monotonic() + self.ttl_s, params)
        self._entries.move_to_end(url)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    async def read(self, url: str) -> dict[str, Any]:
        cached = self.get(url)
        if cached is not None:
            return cached
        answer = await client.get_json(url + SERVER_INFO_PATH, timeout=SERVER_INFO_TIMEOUT_S, stage="context")
        params = peer_params(answer)
        self.put(url, params)
        return params


SERVER_INFO = ServerInfoCache()
_warned_unsigned = False


def generation_request_first(
    chat: dict[str, Any],
    disagg_request_id: int,
    context_params: Mapping[str, Any],
    schedule_style: str,
    conversation_id: str | None = None,
) -> dict[str, Any]:
    """Generation-first: the generation worker waits for the KV of `disagg_request_id` from the
    context server that reported `context_params` (`peer_params`)."""
    body = streamed(chat)
    params: dict[str, Any] = {
        "request_type": "generation_only",
        "ctx_request_id": disagg_request_id,
        "disagg_request_id": disagg_request_id,
        "schedule_style": schedule_style,
    }
    if conversation_id:
        params["conversation_id"] = conversation_id
    params.update({k: context_params[k] for k in PEER_FIELDS if k in context_params})
    body["disaggregated_params"] = params
    return body


def streamed(chat: dict[str, Any]) -> dict[str, Any]:
    """The request as a generation worker streams it (usage on every chunk for message_start)."""
    return streamed_request(chat, USAGE_ON_EVERY_CHUNK, without=("disaggregated_params",))


class TrtllmProtocol(WorkerProtocol):
    """The functions above behind the `WorkerProtocol` interface.

    They are looked up in this module when called, so a test that replaces one (as
    `tests/e2e/test_cancellation.py` does) changes what the pipeline runs.
    """

    name: ClassVar[str] = "trtllm"
    label: ClassVar[str] = "TensorRT-LLM (disaggregated_params)"
    schedules: ClassVar[frozenset[str]] = frozenset({CONTEXT_FIRST, GENERATION_FIRST, AGGREGATED})
    error_wordings: ClassVar[Wordings] = WORDINGS
    # trtllm-serve salts the root of the request's KV block chain with it (since PR #7106, merged 2025-08);
    # its request models forbid unknown fields, so an older server refuses every salted request
    # (400): a pool of those must share its cache.
    cache_salt_field: ClassVar[str | None] = "cache_salt"
    relayed_ints_field: ClassVar[str | None] = "prompt_token_ids"
    # tensorrt_llm/metrics/collector.py (MetricsCollector.log_iteration_stats), mounted at
    # /prometheus/metrics by trtllm-serve (tensorrt_llm/serve/openai_server.py; its /metrics is JSON
    # iteration stats); the iteration gauges need `enable_iter_perf_stats`. Labelled `model_name`
    # and `engine_type`; `kv_cache_utilization` is used blocks over the maximum.
    metrics_path: ClassVar[str | None] = "/prometheus/metrics"
    load_metrics: ClassVar[LoadMetrics | None] = LoadMetrics(
        waiting=("trtllm_num_requests_waiting",),
        running=("trtllm_num_requests_running",),
        kv_usage=("trtllm_kv_cache_utilization",),
    )

    def headers(self, body: dict[str, Any], call: Call) -> Mapping[str, str]:
        if not needs_signature(body):
            return {}
        if not call.signing_key:
            # As upstream's proxy does without `internal_request_auth_key`: sent unsigned (said
            # once per process: a worker with a key refuses it, and the audit row says why).
            global _warned_unsigned
            if not _warned_unsigned:
                _warned_unsigned = True
                logger.warning("a TensorRT-LLM pool has no handoff signing key: signed handoff fields go unsigned")
            return {}
        return {AUTH_HEADER: sign(call.signing_key, body["disaggregated_params"])}

    def explain_error(self, error: WorkerError, call: Call) -> WorkerError:
        if not is_auth_rejection(error):
            return error
        why = "the pool has a handoff signing key the worker does not share" if call.signing_key else "the pool has no handoff signing key"
        return WorkerError(
            500,
            f"the {error.stage} worker refused the gateway's handoff authentication",
            stage=error.stage,
            code="handoff_auth_rejected",
            detail=f"{why}; the worker said: {error.detail}",
        )

    async def describe_context_peer(self, peer: ContextPeer) -> ContextPeer:
        params = await SERVER_INFO.read(peer.url)
        return ContextPeer(url=peer.url, options=peer.options, info=params)

    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return self.salted(streamed(chat), call)

    def context_request(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, schedule_style: str, context: ContextPeer
    ) -> dict[str, Any]:
        ids_as_b64 = context.options.get(IDS_AS_B64_OPTION) is True
        return self.salted(context_request(chat, pair_id, schedule_style, call.conversation_id, ids_as_b64), call)

    def read_context_answer(self, answer: dict[str, Any]) -> Handoff:
        return read_context_response(answer)

    def generation_request_after_context(self, chat: dict[str, Any], call: Call, handoff: Handoff) -> dict[str, Any]:
        if not isinstance(handoff, ContextResult):
            raise TypeError(f"not a TensorRT-LLM handoff: {type(handoff).__name__}")
        return self.salted(generation_request_after_context(chat, handoff, CONTEXT_FIRST, call.conversation_id), call)

    def generation_request_first(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, context: ContextPeer, schedule_style: str
    ) -> dict[str, Any]:
        return self.salted(generation_request_first(chat, pair_id, context.info, schedule_style, call.conversation_id), call)


PROTOCOL = TrtllmProtocol()
