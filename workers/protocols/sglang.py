"""SGLang's prefill/decode disaggregation: one body to both workers, paired by a bootstrap room.

What `sglang-router --pd-disaggregation` does (sgl-project/sglang
`sgl-model-gateway/src/routers/http/pd_router.rs`, `execute_dual_dispatch`,
`inject_bootstrap_into_value`; `pd_types.rs`, `generate_room_id`): it adds

    bootstrap_host   the prefill endpoint's host (parsed from its URL)
    bootstrap_port   the prefill server's `--disaggregation-bootstrap-port`, configured per
                     prefill endpoint (null when none is)
    bootstrap_room   a random integer in 0..2^63-1, new for every attempt

to the chat request and sends it to the prefill and the decode server at once. The decode
server connects to the prefill server's bootstrap port, waits there for the room's KV, and
streams the answer; the prefill server's answer is read to its end and dropped.

Here that is the `generation_first` schedule: the decode request goes out first, the prefill
request right after, and the pipeline awaits both. The room is the pipeline's pairing id (62
random bits, inside the router's range). `bootstrap_port` comes from the context endpoint's
`options["bootstrap_port"]`.

The prefill leg is sent with `stream: false` (and no `stream_options`), where the router sends
it streamed when the client streams: the pipeline reads a context answer as one JSON object, and
the answer is dropped either way. A prefill server's OpenAI route serves a non-streamed request
like any other (stream only chooses how the answer is written; the KV transfer is started by the
bootstrap fields), and it is what the router itself sends for a non-streamed request.

`aggregated` sends the request, with no bootstrap fields, to a generation endpoint: it is for a
pool of SGLang servers run without disaggregation. A decode-mode server refuses a request with
no bootstrap room (HTTP 400), so conditional disaggregation (`max_local_prefill_tokens`) cannot
serve its short prompts from a pool of decode servers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from workers.exceptions import WorkerError
from workers.protocols.base import (
    AGGREGATED,
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
from workers.wire.error_reading import Wordings, wording

logger = logging.getLogger(__name__)

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# The router draws rooms in 0..2^63-1 (`generate_room_id`); workers read them as signed 64-bit.
MAX_ROOM = 2**63 - 1

# SGLang's sentences for a request that does not fit (`WorkerProtocol.error_wordings`), from
# managers/tokenizer_manager.py `_validate_one_request`.
WORDINGS: Wordings = (
    # "The input (4097 tokens) is longer than the model's context length (4096 tokens)."
    wording(r"The input \((?P<prompt>\d{1,12}) tokens\) is longer than the model's context length \((?P<maximum>\d{1,12}) tokens\)"),
    # "Requested token count exceeds the model's maximum context length of 4096 tokens. You
    # requested a total of 4200 tokens: 200 tokens from the input messages and 4000 tokens for the
    # completion. ..."
    wording(
        r"Requested token count exceeds the model's maximum context length of (?P<maximum>\d{1,12}) tokens\. "
        r"You requested a total of \d+ tokens: (?P<prompt>\d{1,12}) tokens from the input messages and "
        r"(?P<output>\d{1,12}) tokens for the completion"
    ),
)


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """The prefill answered (a `Handoff`): the decode server, already waiting, takes over."""

    prompt_tokens: int | None

    @property
    def generation_pending(self) -> bool:
        return True

    @property
    def complete_answer(self) -> dict[str, Any] | None:
        return None

    @property
    def prompt_ids_reader(self) -> Callable[[], list[int]] | None:
        return None  # its prefill answer does not carry them


def bootstrap_fields(context: ContextPeer, room: int) -> dict[str, Any]:
    """The three fields both legs carry: where the decode server finds the prefill's KV."""
    if not 0 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room {room} is outside 0..2^63-1")
    host = urlsplit(context.url).hostname
    if not host:
        raise _misconfigured(f"context endpoint URL has no host: {context.url!r}")
    return {"bootstrap_host": host, "bootstrap_port": bootstrap_port(context.options), "bootstrap_room": room}


def bootstrap_port(options: Mapping[str, Any]) -> int | None:
    """The endpoint's configured bootstrap port; None when it has none (the router sends null)."""
    port = options.get("bootstrap_port")
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _misconfigured(f"bootstrap_port must be a TCP port number, not {port!r}")
    return port


def _misconfigured(detail: str) -> WorkerError:
    # An operator's setting, not the client's request or the worker's answer: logged for the
    # operator, a generic message for the client.
    logger.error("SGLang context endpoint misconfigured: %s", detail)
    return WorkerError(500, "the worker pool for this model is misconfigured", stage="context", code="misconfigured", detail=detail)


def streamed(chat: dict[str, Any]) -> dict[str, Any]:
    return streamed_request(chat, USAGE_ON_EVERY_CHUNK, without=BOOTSTRAP_FIELDS)


def prefill_request(chat: dict[str, Any], context: ContextPeer, room: int) -> dict[str, Any]:
    body = answered_request(chat, without=BOOTSTRAP_FIELDS)
    body.update(bootstrap_fields(context, room))
    return body


def decode_request(chat: dict[str, Any], context: ContextPeer, room: int) -> dict[str, Any]:
    body = streamed(chat)
    body.update(bootstrap_fields(context, room))
    return body


def read_prefill_answer(answer: dict[str, Any]) -> PrefillDone:
    """The prefill's answer is dropped; only its prompt token count is kept, if it is sound."""
    return PrefillDone(reported_prompt_tokens(answer))


class SglangProtocol(WorkerProtocol):
    name: ClassVar[str] = "sglang"
    label: ClassVar[str] = "SGLang (bootstrap room, prefill and decode at once)"
    # A decode-mode server refuses a request without a bootstrap room (HTTP 400).
    generation_serves_whole_requests: ClassVar[bool] = False
    schedules: ClassVar[frozenset[str]] = frozenset({GENERATION_FIRST, AGGREGATED})
    error_wordings: ClassVar[Wordings] = WORDINGS
    # SGLang's OpenAI server joins `cache_salt` and `extra_key` into the request's `extra_key`,
    # which namespaces its radix cache (`OpenAIServingBase._compute_extra_key`); servers from
    # before the field drop it (pydantic's default `extra="ignore"`) and share their cache.
    cache_salt_field: ClassVar[str | None] = "cache_salt"
    # python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector), served at /metrics when
    # the server runs with --enable-metrics: gauges labelled `model_name` (and, in newer releases,
    # the ranks). `token_usage` is the fraction of the KV pool's tokens in use.
    metrics_path: ClassVar[str | None] = "/metrics"
    load_metrics: ClassVar[LoadMetrics | None] = LoadMetrics(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_usage=("sglang:token_usage",),
    )

    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return self.salted(streamed(chat), call)

    def context_request(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, schedule_style: str, context: ContextPeer
    ) -> dict[str, Any]:
        return self.salted(prefill_request(chat, context, pair_id), call)

    def read_context_answer(self, answer: dict[str, Any]) -> Handoff:
        return read_prefill_answer(answer)

    def generation_request_first(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, context: ContextPeer, schedule_style: str
    ) -> dict[str, Any]:
        return self.salted(decode_request(chat, context, pair_id), call)


PROTOCOL = SglangProtocol()
