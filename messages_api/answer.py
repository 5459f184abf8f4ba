"""A Messages request answered without HTTP, and the end of one that failed.

    message = await serve(body, principal, record, priority=p, session_of=..., reply=Answer.message)
    # returned: the record ended COMPLETED; raised: the caller ends it (`end_failed`)

`serve` is the one path of every Messages request, the HTTP consumer's streamed and non-streamed
answers and `answer_message` alike: bounded intake (parse, validate, convert), the pool for its
model, the key's limits, a `ChatRun`, the reply (`reply`, given the open run as an `Answer`), and
the key's usage settled whichever way the run ends. `answer_message` is that path with the
Anthropic Message the run accumulates to as its reply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from disagg_project import tracing
from messages_api import intake, trace_content
from messages_api.accumulate import accumulate_message
from messages_api.audit import AuditRecord, sample_anonymous, sample_refused
from messages_api.auth import Principal
from messages_api.errors import AnthropicError, client_error, operator_detail
from messages_api.limits import Usage, check_limits, refuse_early
from messages_api.models import RequestStatus
from messages_api.reframe import StreamReframer
from messages_api.selection import new_message_id, pool_for_model
from messages_api.trace_content import ContentRecorder
from workers import ChatRun, Gather, Priority

__all__ = ["Answer", "answer_message", "end_failed", "serve"]

Reply = TypeVar("Reply")


@dataclass(slots=True)
class Answer:
    """An accepted Messages request with its run open: what its reply is made from."""

    request: dict[str, Any]  # the validated Anthropic request
    run: ChatRun
    reframer: StreamReframer  # the run's OpenAI chunks as Anthropic events
    headers: list[tuple[bytes, bytes]]  # the key's anthropic-ratelimit-* headers, for the reply
    record: AuditRecord
    recorder: ContentRecorder | None = None  # the answer's content for the trace (opt-in)

    async def relay(self, sink: Callable[[dict[str, Any]], None], gather: Gather | None = None) -> None:
        """The run's relay (`ChatRun.relay`), its chunks recorded first when content is traced."""
        if self.recorder is not None:
            sink = self.recorder.wrap(sink)
        await self.run.relay(sink, gather)

    async def message(self) -> dict[str, Any]:
        """The whole reply as one Anthropic Message."""
        run, reframer = self.run, self.reframer
        await run.stream_ready()
        self.record.progress()
        events: list[dict[str, Any]] = []
        # Bounded: past max_tokens the reframer ends the message and the relay stops (reframe.py).
        await self.relay(lambda chunk: events.extend(reframer.feed(chunk)))
        events.extend(reframer.finish())
        return accumulate_message(events)


async def serve(
    body: bytes,
    principal: Principal,
    record: AuditRecord,
    *,
    priority: Priority,
    session_of: Callable[[dict[str, Any]], str | None],
    reply: Callable[[Answer], Awaitable[Reply]],
) -> Reply:
    """Accept `body` for `principal`, open its run, and return what `reply` makes of it.

    Before acceptance it raises the client's error: the key known over its limits before the
    body is parsed, the body's own errors, a model the key may not use (`NotFound`), the key's
    limits (`RateLimited`). Then the record is begun and `reply` runs inside the run; every way
    out settles the key's lease with the tokens the reply used, and a reply that returns ends the
    record COMPLETED (200). `session_of` gives the request's session for affinity, from the
    validated request."""
    # A key this process already knows is over its limits is refused before its body is parsed.
    refuse_early(principal.key_hash, principal.limits)
    request, chat, rendered, cache_share = await _intake(body)
    record.model = request["model"]
    record.stream = bool(request.get("stream"))
    pool = await pool_for_model(request["model"], principal, chat)
    record.pool_name = pool.name
    record.max_tokens, record.priority = request["max_tokens"], priority  # the request span's attributes
    run = ChatRun(
        chat, pool=pool, request_id=record.request_id, session=session_of(request),
        tenant=record.api_key_name, priority=priority, size=len(body),
        cache_salt=principal.cache_salt or None, rendered=rendered,
    )
    # Over a limit: 429 before the request is accepted (its row is `rejected`).
    lease = await check_limits(principal.key_hash, principal.limits, Usage(run.estimated_prompt_tokens, request["max_tokens"]))
    reframer = StreamReframer(
        message_id=new_message_id(),
        model=request["model"],
        stop_sequences=request.get("stop_sequences"),
        # message_start's count when the worker reports usage only at the end (a plain
        # OpenAI-compatible server has no per-chunk usage); the worker's count replaces it.
        input_tokens=run.estimated_prompt_tokens,
        cache_share=cache_share,
        # Enforced here, whatever the worker does: the relay stops at it (reframe.py).
        max_tokens=request["max_tokens"],
    )
    # Traced with TRACE_RECORD_CONTENT on: the prompt on the request's span now, the answer at the end.
    recorder = trace_content.recorder_for(record, request) if record.trace_id else None
    try:
        record.begin()
        record.run = run  # the audit reads the run's progress (stage, endpoints, timings) when it writes
        async with run:
            replied = await reply(Answer(request, run, reframer, lease.headers, record, recorder))
    finally:
        # Whichever way the run ended: what the reply used, for the row and the key's usage.
        if reframer.started:
            record.input_tokens = reframer.input_tokens
            record.output_tokens = reframer.output_tokens
            record.cache_read_input_tokens = reframer.cache_read_input_tokens
            record.cache_creation_input_tokens = reframer.cache_creation_input_tokens
            record.stop_reason = reframer.stop_reason  # gen_ai.response.finish_reasons
        if recorder is not None:
            recorder.finish(record.stop_reason)
        # Anthropic's input-token limits count what was written to the cache too.
        used = Usage((record.input_tokens or 0) + (record.cache_creation_input_tokens or 0), record.output_tokens or 0)
        lease.settle(used)
        run.charge_output(used.output_tokens)
    record.end(RequestStatus.COMPLETED, http_status=200)
    return replied


async def _intake(body: bytes) -> intake.Prepared:
    """`intake.messages_request`; traced, as a span of its own (`gateway.intake`), which a
    refusal ends in the error status with Anthropic's error type."""
    if not tracing.on:
        return await intake.messages_request(body)
    span = tracing.child("gateway.intake", {"gateway.request.body_bytes": len(body)})
    try:
        converted = await intake.messages_request(body)
    except BaseException as exc:
        tracing.end(span, client_error(exc).error_type if isinstance(exc, Exception) else exc)
        raise
    tracing.end(span)
    return converted


async def answer_message(
    body: bytes, principal: Principal, record: AuditRecord, *, priority: Priority,
    session: str | None = None,
) -> dict[str, Any]:
    """One non-streamed Messages request without HTTP: bounded intake (parse, validate, convert),
    the pool for its model (a model the key may not use is a 404), the key's limits (over them:
    raises the 429 error before the request is accepted), a ChatRun at `priority`, reframing, and
    the Anthropic Message it accumulates to. On success the record is ended COMPLETED. On failure
    it raises (front-door errors or workers' WorkerError) and leaves the record for the caller."""
    try:
        return await serve(
            body, principal, record, priority=priority, session_of=lambda _request: session, reply=Answer.message
        )
    finally:
        intake.release(len(body))


def end_failed(
    record: AuditRecord, exc: BaseException, *, http_status: int | None = None, sample_refusals: bool = False
) -> AnthropicError:
    """Map a failure to the client's error (errors.client_error) and end the record with it
    (`rejected` for the client's fault before acceptance, `failed` otherwise). The HTTP consumer's
    error boundary and the batch runner both use it.

    `http_status`: the status line already sent, when the reply had started (else the error's).
    `sample_refusals`: a request refused before it was accepted is counted in the metrics (and
    its key's usage) always but written only as a sample (audit.sample_refused for a known key,
    audit.sample_anonymous for the others), so that a flood of refused requests cannot fill the
    database; the HTTP consumer asks for it. An ended record is left as it was."""
    error = client_error(exc)
    detail = operator_detail(exc, error)
    persist = True
    if sample_refusals and not record.begun:
        sampled = sample_refused(record.api_key_name, detail) if record.api_key_name else sample_anonymous(detail)
        persist = sampled is not None
        detail = sampled or detail
    record.end(
        RequestStatus.REJECTED if error.status < 500 and not record.begun else RequestStatus.FAILED,
        http_status=http_status or error.status,
        error_type=error.error_type,
        error_message=detail,
        persist=persist,
    )
    return error
