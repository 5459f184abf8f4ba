"""The interface every worker protocol implements, and the neutral handoff between its phases.

A protocol turns one OpenAI chat request into the worker requests of a schedule and reads the
context worker's answer. The pipeline (`workers.schedule.pipeline`, with the schedules'
order in `workers.schedule.schedules`) drives the schedule: it routes, reserves, sends, retries
and cleans up, and never looks inside what a protocol builds or reads.

Schedules (`ScheduleStyle` values):

- `aggregated`: one request, whole, to a generation endpoint (no context phase). Every protocol
  can do this: it is also how conditional disaggregation serves short prompts.
- `context_first`: the context request, then a generation request carrying the handoff that the
  context worker answered with.
- `generation_first`: the generation request goes out first and waits on its worker for the
  KV of a pairing id; the context request follows.

A protocol that has no context phase (a plain OpenAI-compatible server) implements only
`aggregated_request` and lists `{"aggregated"}` as its schedules; the pipeline never calls the
disaggregated builders of a protocol for a schedule it does not list (a system check and the
pool's validation keep such pools from being configured).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from workers.exceptions import WorkerError
from workers.protocols.engine_load import EngineLoad, LoadMetrics, read_load
from workers.wire.error_reading import Wordings

AGGREGATED = "aggregated"
CONTEXT_FIRST = "context_first"
GENERATION_FIRST = "generation_first"

#: `stream_options` for usage on every chunk (`continuous_usage_stats`, which vLLM's, SGLang's and
#: TensorRT-LLM's OpenAI servers honour): the first chunk carries the prompt's token count, for
#: message_start.
USAGE_ON_EVERY_CHUNK = {"include_usage": True, "continuous_usage_stats": True}


@dataclass(frozen=True, slots=True)
class ContextPeer:
    """The context endpoint a request's context phase runs on, as the generation side needs it.

    `options` are the endpoint's operator-set options (e.g. SGLang's `bootstrap_port`); `info` is
    what the protocol discovered about the endpoint (`WorkerProtocol.describe_context_peer`, e.g.
    TensorRT-LLM's `/server_info`).
    """

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Call:
    """What a protocol may need to know about the request beyond its chat body."""

    #: The gateway's request id (sent to workers as `X-Request-Id` where the engine reads it).
    request_id: str
    #: The client's conversation (session) id, when it sent one.
    conversation_id: str | None = None
    #: The pool's shared secret for signed handoffs ("" when none is set). Never log it.
    signing_key: str = field(default="", repr=False)
    #: The prefix-cache namespace of the request's tenant, for engines that salt their cache
    #: (`WorkerProtocol.cache_salt_field`); None when the pool's keys share one cache. Derived from
    #: the key's identity, never its secret; kept out of logs all the same (with it, a request sent
    #: to a worker directly would read that tenant's cache).
    cache_salt: str | None = field(default=None, repr=False)
    #: Ask the generation worker for the prompt's token ids (vLLM's `return_token_ids`): its
    #: engine's KV-cache events are followed, and the ids join the conversation to its blocks
    #: (`workers.kv_events.subscriber.KvEvents.learn`).
    return_token_ids: bool = False


class Handoff(Protocol):
    """What the context phase handed over, opaque to the pipeline beyond these three questions."""

    @property
    def generation_pending(self) -> bool:
        """A generation request must follow (the context worker holds KV for it)."""

    @property
    def complete_answer(self) -> dict[str, Any] | None:
        """The context worker already produced the whole answer (an OpenAI chat completion):
        there is nothing for a generation worker to do."""

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's token count as the context worker counted it, if it said."""

    @property
    def prompt_ids_reader(self) -> Callable[[], list[int]] | None:
        """Reads the prompt's token ids from what the context worker sent, in whatever form it
        sent them (None: it sent none). Called off the event loop, by the KV-event join
        (`workers.kv_events`): a Claude Code prompt is ~20,000 ids."""


#: Fields only the gateway sets on a worker request, whatever the chat body carries: the engines'
#: prefix-cache salt (`WorkerProtocol.salted`).
GATEWAY_FIELDS = frozenset({"cache_salt"})


def streamed_request(
    chat: Mapping[str, Any], stream_options: Mapping[str, Any], *, without: Iterable[str] = ()
) -> dict[str, Any]:
    """`chat` as a worker streams it: `stream` on with the protocol's `stream_options`, and none of
    the `without` fields (the protocol's handoff fields, which only the protocol may set) nor the
    `GATEWAY_FIELDS`."""
    dropped = GATEWAY_FIELDS.union(without)
    body = {k: v for k, v in chat.items() if k not in dropped}
    body["stream"] = True
    body["stream_options"] = dict(stream_options)
    return body


def reported_prompt_tokens(answer: Mapping[str, Any]) -> int | None:
    """The prompt's token count a context worker's answer reports (`usage.prompt_tokens`), if it
    is one: a non-negative integer, not a bool; None otherwise."""
    usage = answer.get("usage")
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return count if type(count) is int and count >= 0 else None


def completion_as_chunks(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A non-streamed chat completion (a context worker's `Handoff.complete_answer`) as the
    stream chunks that would have carried it: the delta, the finish, and the usage if it has one."""
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    delta: dict[str, Any] = {"role": "assistant"}
    for key in ("content", "reasoning_content", "tool_calls"):
        if message.get(key):
            delta[key] = message[key]
    if "tool_calls" in delta:
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
    base = {"id": response.get("id", ""), "object": "chat.completion.chunk", "model": response.get("model", "")}
    stop_reason = {"stop_reason": choice["stop_reason"]} if choice.get("stop_reason") is not None else {}
    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason") or "stop", **stop_reason}]},
    ]
    if response.get("usage"):
        chunks.append({**base, "choices": [], "usage": response["usage"]})
    return chunks


def answered_request(chat: Mapping[str, Any], *, without: Iterable[str] = ()) -> dict[str, Any]:
    """`chat` as a worker answers it in one JSON object (a context or prefill request): `stream`
    off and no `stream_options`, which engines refuse without `stream`; nor `GATEWAY_FIELDS`."""
    dropped = GATEWAY_FIELDS.union(without, ("stream_options",))
    body = {k: v for k, v in chat.items() if k not in dropped}
    body["stream"] = False
    return body


class WorkerProtocol(ABC):
    """How one engine family splits a chat request between context and generation workers.

    Implementations are stateless: one instance serves every pool that names it.
    """

    #: The value of `WorkerPool.protocol` that selects this protocol.
    name: ClassVar[str]
    #: Shown in the admin's choice list.
    label: ClassVar[str]
    #: The schedules (`ScheduleStyle` values) this protocol can run.
    schedules: ClassVar[frozenset[str]]
    #: Path of the chat endpoint on a worker's base URL.
    chat_path: ClassVar[str] = "/v1/chat/completions"
    #: Whether a disaggregating pool's generation endpoints also serve a whole request (the
    #: `aggregated_request`), as conditional disaggregation sends short prompts. False where the
    #: engine's decode servers refuse a request without a handoff (SGLang's decode mode).
    generation_serves_whole_requests: ClassVar[bool] = True
    #: How the engine words a request that does not fit its context window, or asks for more
    #: output than the window holds (`workers.wire.error_reading.Wording`): its workers' error
    #: answers are read with them, to tell the client which (Claude Code compacts on one).
    error_wordings: ClassVar[Wordings] = ()
    #: The request field the engine salts its prefix cache with (vLLM's, SGLang's and
    #: TensorRT-LLM's `cache_salt`): requests with different salts reuse none of each other's KV
    #: blocks. None where the engine has no such field: the gateway cannot keep one tenant's
    #: prompts out of another's cache hits there, and reports no cache hit to a pool that keeps
    #: keys apart (`workers.schedule.cache_feedback.hide_cached_tokens`).
    cache_salt_field: ClassVar[str | None] = None
    #: A field of the context answer holding a large array of ints the gateway only relays to the
    #: generation worker (TensorRT-LLM's `prompt_token_ids`): read as its JSON text, never as
    #: Python ints (`workers.wire.raw_ints`). None: the answer is parsed whole.
    relayed_ints_field: ClassVar[str | None] = None
    #: Path of the engine's Prometheus metrics on a worker's base URL, and the names of its load
    #: figures there (`workers.protocols.engine_load`). None: the gateway reads no load from the
    #: engine and routes on its own counts alone (`workers.cluster.engine_load`).
    metrics_path: ClassVar[str | None] = None
    load_metrics: ClassVar[LoadMetrics | None] = None

    def read_load(self, scrape: str, model: str | None = None) -> EngineLoad | None:
        """The engine's load in a scrape of its `metrics_path` (`model`: the pool's model, for an
        engine that labels its series by model), or None when it says none."""
        if self.load_metrics is None:
            return None
        return read_load(scrape, self.load_metrics, model)

    def salted(self, body: dict[str, Any], call: Call) -> dict[str, Any]:
        """`body` with the call's cache salt in the engine's field (every leg of a request carries
        the same one, so a context worker's KV and the generation worker's own cache agree)."""
        if call.cache_salt is not None and self.cache_salt_field is not None:
            body[self.cache_salt_field] = call.cache_salt
        return body

    def headers(self, body: dict[str, Any], call: Call) -> Mapping[str, str]:
        """Extra HTTP headers a worker request with `body` needs (signatures, request ids)."""
        return {}

    def explain_error(self, error: WorkerError, call: Call) -> WorkerError:
        """The gateway's reading of a worker's error answer to a request this protocol built: an
        engine's refusal of what the gateway sent (e.g. a handoff signature) is the gateway's
        failure, not the client's. The default reads every error as it is."""
        return error

    async def describe_context_peer(self, peer: ContextPeer) -> ContextPeer:
        """What the generation side must know about a context endpoint before a generation-first
        request names it (e.g. TensorRT-LLM reads the endpoint's `/server_info`). Runs once per
        generation-first request, before `generation_request_first`; may cache; raises
        `WorkerError` when the endpoint cannot say. The default needs nothing."""
        return peer

    @abstractmethod
    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        """The whole request for one generation worker, streamed (the context phase skipped)."""

    def context_request(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, schedule_style: str, context: ContextPeer
    ) -> dict[str, Any]:
        """The context (prefill) request to the endpoint `context`, answered as one JSON object."""
        raise self._unsupported("a context phase")

    def read_context_answer(self, answer: dict[str, Any]) -> Handoff:
        """Check the context worker's answer and keep what the generation request needs.

        Raises `WorkerError` (502) when the answer lacks what the protocol requires.
        """
        raise self._unsupported("a context phase")

    def generation_request_after_context(self, chat: dict[str, Any], call: Call, handoff: Handoff) -> dict[str, Any]:
        """Context first: the streamed generation request that takes over `handoff`."""
        raise self._unsupported(CONTEXT_FIRST)

    def generation_request_first(
        self, chat: dict[str, Any], call: Call, *, pair_id: int, context: ContextPeer, schedule_style: str
    ) -> dict[str, Any]:
        """Generation first: the streamed generation request, sent before (or with) the context
        request of the same `pair_id`, that waits for the KV from the endpoint `context` (as
        `describe_context_peer` described it)."""
        raise self._unsupported(GENERATION_FIRST)

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name} protocol has no {what}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
