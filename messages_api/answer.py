"""One non-streamed Messages request answered without HTTP: what a Message Batch item runs.

PROVISIONAL COPY (branch `batches`): the shared `answer_message` / `end_failed` are built by the
`consumers` helper (CONTRACTS.md), and the HTTP consumer's answers go through them; the lead
replaces this file with that one on merge. It has exactly the contract's signatures and reuses
the same steps `MessagesConsumer.handle_message` and `respond_json` take today.
"""

from __future__ import annotations

from typing import Any

from messages_api import intake
from messages_api.accumulate import accumulate_message
from messages_api.audit import AuditRecord
from messages_api.auth import Principal
from messages_api.consumers import new_message_id, pool_for_model
from messages_api.errors import AnthropicError, client_error, operator_detail
from messages_api.limits import Usage, check_limits, refuse_early
from messages_api.models import RequestStatus
from messages_api.reframe import StreamReframer
from workers import ChatRun, Priority

__all__ = ["answer_message", "end_failed"]


async def answer_message(
    body: bytes, principal: Principal, record: AuditRecord, *, priority: Priority, session: str | None = None,
) -> dict[str, Any]:
    """One non-streamed Messages request without HTTP: bounded intake (parse, validate, convert),
    the pool for its model (a model the key may not use is a 404), the key's limits (over them:
    raises the 429 error before the request is accepted), a ChatRun at `priority`, reframing, and
    the Anthropic Message it accumulates to. On success the record is ended COMPLETED. On failure
    it raises (front-door errors or workers' WorkerError) and leaves the record for the caller."""
    refuse_early(principal.key_hash, principal.limits)
    request, chat, rendered, cache_share = await intake.messages_request(body)
    record.model = request["model"]
    record.stream = False
    pool = await pool_for_model(request["model"], principal, chat)
    record.pool_name = pool.name
    run = ChatRun(
        chat, pool=pool, request_id=record.request_id, session=session, tenant=record.api_key_name,
        priority=priority, size=len(body), cache_salt=principal.cache_salt or None, rendered=rendered,
    )
    lease = await check_limits(principal.key_hash, principal.limits, Usage(run.estimated_prompt_tokens, request["max_tokens"]))
    reframer: StreamReframer | None = None
    try:
        record.begin()
        reframer = StreamReframer(
            message_id=new_message_id(), model=request["model"], stop_sequences=request.get("stop_sequences"),
            input_tokens=run.estimated_prompt_tokens, cache_share=cache_share, max_tokens=request["max_tokens"],
        )
        record.run = run
        try:
            async with run:
                await run.stream_ready()
                record.progress()
                events: list[dict[str, Any]] = []
                feed = reframer.feed
                await run.relay(lambda chunk: events.extend(feed(chunk)))
                events.extend(reframer.finish())
                message = accumulate_message(events)
        finally:
            if reframer.started:
                record.input_tokens = reframer.input_tokens
                record.output_tokens = reframer.output_tokens
                record.cache_read_input_tokens = reframer.cache_read_input_tokens
                record.cache_creation_input_tokens = reframer.cache_creation_input_tokens
    finally:
        used = Usage((record.input_tokens or 0) + (record.cache_creation_input_tokens or 0), record.output_tokens or 0)
        lease.settle(used)
        run.charge_output(used.output_tokens)
    record.end(RequestStatus.COMPLETED, http_status=200)
    return message


def end_failed(record: AuditRecord, exc: BaseException) -> AnthropicError:
    """Map a failure to the client's error (errors.client_error) and end the record with it
    (`rejected` for the client's fault before acceptance, `failed` otherwise). The HTTP consumer's
    error boundary and the batch runner both use it."""
    error = client_error(exc)
    record.end(
        RequestStatus.REJECTED if error.status < 500 and not record.begun else RequestStatus.FAILED,
        http_status=error.status,
        error_type=error.error_type,
        error_message=operator_detail(exc, error),
    )
    return error
