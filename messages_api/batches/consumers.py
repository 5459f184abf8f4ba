"""The Message Batches routes' consumers (`ApiConsumer`s: the same body collection, error
boundary, JSON replies and authentication as `/v1/messages`).

    POST   /v1/messages/batches                 create          BatchesConsumer
    GET    /v1/messages/batches                 list            BatchesConsumer
    GET    /v1/messages/batches/{id}            retrieve        BatchConsumer
    DELETE /v1/messages/batches/{id}            delete          BatchConsumer
    POST   /v1/messages/batches/{id}/cancel     cancel          BatchCancelConsumer
    GET    /v1/messages/batches/{id}/results    results (JSONL) BatchResultsConsumer

The beta form (`?beta=true`, `anthropic-beta: message-batches-2024-09-24`) is the same request:
the query string and the header change nothing. A batch belongs to the key that created it:
another key's request for it is answered as for a batch that does not exist (404).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs

from django.conf import settings

from disagg_project import tracing
from messages_api import intake
from messages_api.batches import runner, store
from messages_api.batches.schema import batch_object, deleted_object, page_query, parse_create_body
from messages_api.consumers import ApiConsumer
from messages_api.errors import AnthropicError

__all__ = ["BatchCancelConsumer", "BatchConsumer", "BatchesConsumer", "BatchResultsConsumer"]

# Create bodies are parsed and checked here, one at a time, off the event loop: a large batch is
# seconds of work.
_CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-create")


def _not_found(batch_id: str) -> AnthropicError:
    return AnthropicError(404, f"message_batch: {batch_id}", "not_found_error")


class _BatchRoute(ApiConsumer):
    """A route under `/v1/messages/batches/{id}`."""

    @property
    def batch_id(self) -> str:
        # URLRouter sets `url_route` on HTTP scopes too; the stubs' HTTPScope does not declare it.
        batch_id: str = self.scope["url_route"]["kwargs"]["batch_id"]  # type: ignore[typeddict-item]
        return batch_id


class BatchesConsumer(ApiConsumer):
    """`POST /v1/messages/batches` (create) and `GET /v1/messages/batches` (list)."""

    allowed_methods = ("POST", "GET")

    @classmethod
    def max_body_bytes(cls) -> int:
        limit: int = settings.BATCH_MAX_BYTES
        return limit

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        if self.scope.get("method") == "GET":
            query = page_query(parse_qs(self.scope.get("query_string", b"").decode()))
            page = await store.API_THREAD.run(store.list_batches, principal.key_id, query)
            data = [batch_object(b) for b in page.batches]
            await self.send_json(
                200,
                {
                    "data": data,
                    "has_more": page.has_more,
                    "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None,
                },
            )
            return
        try:
            items = await asyncio.get_running_loop().run_in_executor(_CHECKS, parse_create_body, body, principal.may_use)
        finally:
            intake.release(len(body))  # a large body's memory goes back to the system once it is dropped
        traceparent = tracing.current_traceparent()  # the request's span: each item's trace links to it
        batch = await store.API_THREAD.run(store.create_batch, principal.key_id, principal.name, items, traceparent)
        runner.wake()
        await self.send_json(200, batch_object(batch))


class BatchConsumer(_BatchRoute):
    """`GET /v1/messages/batches/{id}` (retrieve) and `DELETE` (only once it has ended)."""

    allowed_methods = ("GET", "DELETE")

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        if self.scope.get("method") == "DELETE":
            outcome = await store.API_THREAD.run(store.delete_batch, principal.key_id, self.batch_id)
            if outcome == "not_found":
                raise _not_found(self.batch_id)
            if outcome == "not_ended":
                raise AnthropicError(
                    400,
                    f"Message Batch {self.batch_id} cannot be deleted while it is processing: cancel it first, "
                    "and delete it once it has ended",
                    "invalid_request_error",
                )
            await self.send_json(200, deleted_object(self.batch_id))
            return
        batch = await store.API_THREAD.run(store.get_batch, principal.key_id, self.batch_id)
        if batch is None:
            raise _not_found(self.batch_id)
        await self.send_json(200, batch_object(batch))


class BatchCancelConsumer(_BatchRoute):
    """`POST /v1/messages/batches/{id}/cancel`: to `canceling` (an ended batch is answered as it is)."""

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        batch = await store.API_THREAD.run(store.cancel_batch, principal.key_id, self.batch_id)
        if batch is None:
            raise _not_found(self.batch_id)
        await self.send_json(200, batch_object(batch))


class BatchResultsConsumer(_BatchRoute):
    """`GET /v1/messages/batches/{id}/results`: one JSON line per item, read from the database in
    chunks of BATCH_RESULTS_CHUNK items and written as each arrives: memory stays one chunk,
    whatever the batch's size, and the first bytes leave after the first read."""

    allowed_methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        found = await store.API_THREAD.run(store.results_batch, principal.key_id, self.batch_id)
        if found is None:
            raise _not_found(self.batch_id)
        batch_pk, batch = found
        if batch.processing_status != "ended":
            raise AnthropicError(
                400, f"Message Batch {self.batch_id} has not ended yet: its results are ready once it has", "invalid_request_error"
            )
        if batch.archived_at is not None:
            raise AnthropicError(404, f"The results of Message Batch {self.batch_id} were archived and are no longer available", "not_found_error")
        size = settings.BATCH_RESULTS_CHUNK
        chunk = await store.API_THREAD.run(store.results_chunk, batch_pk, 0, size)
        self.response_started = True
        self.sent_status = 200
        await self.send_headers(status=200, headers=self.response_headers(b"application/binary"))
        while chunk:
            await self.send_body(b"".join(_line(custom_id, result) for _, custom_id, result in chunk), more_body=True)
            if len(chunk) < size:
                break
            chunk = await store.API_THREAD.run(store.results_chunk, batch_pk, chunk[-1][0], size)
        await self.send_body(b"", more_body=False)


def _line(custom_id: str, result: str) -> bytes:
    # The stored result is the line's `result` object as JSON already; custom_id matches
    # ^[a-zA-Z0-9_-]{1,64}$, which needs no escaping.
    return b'{"custom_id":"%s","result":%s}\n' % (custom_id.encode(), result.encode())
