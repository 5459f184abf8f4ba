"""`ApiConsumer`: what every API route's consumer shares.

Body collection with the size guard, the task the request runs in (`dispatch.RequestTask`), the
one error boundary, JSON replies, and authentication. A route's consumer implements
`handle_request(body)`: it raises, it never answers an error itself. Whatever leaves it — an
`AnthropicError`, a `WorkerError`, the request's deadline, a bug — reaches `_answer_error`, which
maps it and ends the audit row once (`answer.end_failed`), and answers: an HTTP error before the
response started, `send_late_error` after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, cast

import orjson
from channels.exceptions import StopConsumer
from channels.generic.http import AsyncHttpConsumer
from channels.layers import get_channel_layer
from django.conf import settings

from disagg_project import drop_tracebacks, tracing
from messages_api import request_span
from messages_api.answer import end_failed
from messages_api.audit import AuditRecord
from messages_api.auth import INVALID_KEY, MISSING_KEY, CredentialError, Principal, key_cache, key_from_headers
from messages_api.consumers.dispatch import RequestTask
from messages_api.consumers.state import ResponseState
from messages_api.errors import (
    AnthropicError,
    AuthenticationFailed,
    DeadlineExceeded,
    MethodNotAllowed,
    Overloaded,
    RequestTooLarge,
    client_error,
)
from messages_api.models import RequestStatus
from messages_api.request_context import current_request_id
from messages_api.revocation import KeyRevoked
from messages_api.server import loop_lag
from messages_api.server.arrival import seconds_since_received
from messages_api.server.backpressure import Backpressure
from messages_api.server.body_writer import BodyWriter, body_writer
from messages_api.server.send_queue import SendQueue
from workers import WorkerError

if TYPE_CHECKING:
    from asgiref.typing import HTTPDisconnectEvent, HTTPRequestEvent

logger = logging.getLogger(__name__)


class ApiConsumer(AsyncHttpConsumer):
    """Body collection with a size limit, the task the request runs in, the one error boundary,
    and JSON replies. `state` says where the response is (`ResponseState`)."""

    allowed_methods: tuple[str, ...] = ("POST",)

    @classmethod
    def max_body_bytes(cls) -> int:
        """The largest body the route takes (413 beyond); the intake guard asks it too (routes.body_limit)."""
        limit: int = settings.MESSAGES_MAX_BODY_BYTES
        return limit

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = AuditRecord()
        self.state = ResponseState.RECEIVING
        # Sent with every answer (the key's anthropic-ratelimit-* headers, once checked).
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.request_headers: dict[bytes, bytes] = {}
        self.sent_status: int | None = None  # the status line sent, for the audit row
        self._body_size = 0
        self._running = RequestTask()
        # Why the gateway cancelled the work while it ran (a revoked key, `revoke`; a stalled
        # client, `cut`): answered through the error boundary, not taken for the client gone.
        self._cut: AnthropicError | None = None
        self._body_writer: BodyWriter | None = None  # see send_body
        self._send_queue: SendQueue | None = None  # the body writer off daphne
        self._backpressure: Backpressure | None = None  # a stream's client pacing its worker, under daphne

    # Channels' stubs type every consumer's scope as a websocket scope (`_ChannelScope`); this
    # HTTP consumer reads HTTP keys from it and passes it on unchanged.
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # type: ignore[override]
        self.record.received_earlier(seconds_since_received(send))
        self.record.route = f"{scope.get('method', '')} {scope.get('path', '')}"
        try:
            if get_channel_layer(self.channel_layer_alias) is None:
                await self._running.serve_in_place(self, scope, receive, send, self._finished)
            else:
                await super().__call__(scope, receive, send)  # type: ignore[arg-type]  # the same stubs' scope type
        finally:
            # The server cancelling the application (shutdown, application-close timeout) takes
            # the same path as a client disconnect.
            await self._running.close()

    def _finished(self) -> bool:
        return self.state is ResponseState.FINISHED

    # --- ASGI message handlers ---------------------------------------------------------------

    async def dispatch(self, message: dict[str, Any]) -> None:
        # The stock dispatch closes stale DB connections on the shared ORM thread before every
        # message (a thread hop per 8 KiB body chunk); these consumers never touch the ORM here.
        # The stubs type `dispatch`'s message as any dict; its `type` says which event it is.
        if message["type"] == "http.request":
            await self.http_request(cast("HTTPRequestEvent", message))
        elif message["type"] == "http.disconnect":
            await self.http_disconnect(cast("HTTPDisconnectEvent", message))

    async def http_request(self, message: HTTPRequestEvent) -> None:
        if self.state is not ResponseState.RECEIVING:
            return  # the rest of a refused body
        if not self.request_headers:
            self.request_headers = dict(self.scope.get("headers") or ())
            declared = self.request_headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes():
                return self._refuse_too_large()
        chunk = message.get("body", b"")
        self._body_size += len(chunk)
        if self._body_size > self.max_body_bytes():
            return self._refuse_too_large()
        self.body.append(chunk)
        if not message.get("more_body", False):
            body, self.body = b"".join(self.body), []
            self._start(self._serve(body))

    async def http_disconnect(self, message: HTTPDisconnectEvent) -> None:
        await self._running.disconnected(self._finished())
        raise StopConsumer()

    def revoke(self) -> None:
        """The request's API key was revoked (messages_api/revocation.py): its work is cancelled,
        and `_serve` answers that cancellation with `KeyRevoked` instead of taking the client for gone."""
        self.cut(KeyRevoked())

    def cut(self, error: AnthropicError) -> None:
        """End the running request with `error` (once; nothing once it has ended): its work is
        cancelled and `_serve` answers that cancellation with `error`."""
        if self._cut is not None or self.state is ResponseState.FINISHED:
            return
        if self._running.cancel():
            self._cut = error

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        self.state = ResponseState.ANSWERING
        self._running.start(work)

    def _refuse_too_large(self) -> None:
        # Answer at once; the rest of the body is never read into memory.
        self.body = []
        error = RequestTooLarge(f"Request body is larger than the limit of {self.max_body_bytes()} bytes")
        self._start(self._answer_error(error))

    # --- sending -------------------------------------------------------------------------------

    def _writer(self) -> BodyWriter:
        """Where middle frames go (see `send_body`): daphne's direct writer, or on another server
        a queue to `send`."""
        writer = self._body_writer
        if writer is None:
            writer = body_writer(self.base_send)
            if writer is None:
                writer = self._send_queue = SendQueue(self._send_middle)
            self._body_writer = writer
        return writer

    async def _send_middle(self, body: bytes) -> None:
        await super().send_body(body, more_body=True)

    async def send_body(self, body: bytes, *, more_body: bool = False) -> None:
        if more_body:
            # A middle frame (an SSE event, a ping), written without waiting: straight to daphne's
            # request under daphne (messages_api/server/body_writer.py), else queued for `send`
            # (messages_api/server/send_queue.py).
            self._writer()(body)
            return
        # The last frame goes through `send`, which ends the response, after every middle one.
        if self._send_queue is not None:
            await self._send_queue.flush()
        if self._backpressure is not None:
            self._backpressure.close()  # before daphne finishes the request (it must be unregistered)
        self.state = ResponseState.FINISHED
        await super().send_body(body, more_body=False)

    # --- the request's work ----------------------------------------------------------------------

    async def _serve(self, body: bytes) -> None:
        """The request's work: everything it raises ends in `_answer_error`, the one boundary."""
        current_request_id.set(self.record.request_id)
        # The request's server span (disagg_project/telemetry.py): ended with the record's outcome.
        span = request_span.start(self.scope, self.request_headers, self.record) if tracing.on else None
        deadline_s = settings.MESSAGES_REQUEST_DEADLINE_S
        try:
            # The deadline counts from the request's arrival (its upload included) to the last byte.
            elapsed = time.monotonic() - self.record.received_monotonic
            deadline = asyncio.timeout(deadline_s - elapsed if deadline_s > 0 else None)
            try:
                async with deadline:
                    if self.scope.get("method") not in self.allowed_methods:
                        raise MethodNotAllowed(
                            f"Method {self.scope.get('method')} is not allowed here",
                            headers=((b"allow", ", ".join(self.allowed_methods).encode()),),
                        )
                    if loop_lag.monitor.overloaded(self.record.received_monotonic):
                        loop_lag.shed.inc()
                        raise Overloaded("Overloaded", retry_after=1.0)
                    await self.handle_request(body)
            except TimeoutError as exc:
                if not deadline.expired():
                    raise  # someone else's timeout: a bug, answered as one
                raise DeadlineExceeded(deadline_s) from exc
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if self._cut is not None and task is not None and task.uncancel() == 0:  # cut, and the client is still here
                await self._answer_error(self._cut)
                return
            if self.record.begun:
                self.record.end(RequestStatus.CANCELLED, http_status=self.sent_status or 499)
            drop_tracebacks(exc)  # no one reads a cancellation's frames: they can go now
            raise
        except Exception as exc:
            await self._answer_error(exc)
        finally:
            if self._send_queue is not None:
                # The response is over (ended, failed, or its client gone): nothing more is sent.
                self._send_queue.close()
            if self._backpressure is not None:
                self._backpressure.close()  # and a stalled client's connection is aborted
            if span is not None:  # its status from the record: the error's type, or cancelled
                request_span.end(span, self.record)

    async def handle_request(self, body: bytes) -> None:
        """The route's work on the complete body (each route's consumer implements it)."""
        raise NotImplementedError

    # --- the error boundary ----------------------------------------------------------------------

    async def _answer_error(self, exc: Exception) -> None:
        """The one place an error becomes an answer and an audit row, whatever raised it and
        whenever: an HTTP error before the response started, `send_late_error` after."""
        current_request_id.set(self.record.request_id)
        unexpected = not isinstance(exc, (AnthropicError, WorkerError))
        if unexpected:
            logger.error("unhandled error", exc_info=exc)
        try:
            error = await self._record_error(exc)
            try:
                if self.state is ResponseState.ANSWERING:
                    await self.send_error(error)
                elif self.state is not ResponseState.FINISHED:
                    await self.send_late_error(error)
            except Exception:
                # The client is gone, or the answer itself failed: the row is written either way.
                logger.warning("could not send the error answer", exc_info=True)
        finally:
            if not unexpected:
                # An expected error's frames are read by no one: dropped, the request is freed at
                # once. A bug's stay with it: its log line is written on another thread, later,
                # and prints the tracebacks of the errors chained to it.
                drop_tracebacks(exc)

    async def _record_error(self, exc: Exception) -> AnthropicError:
        """End the audit row (`answer.end_failed`, refusals sampled); the client's error."""
        record = self.record
        if not record.begun and not record.api_key_name and client_error(exc).status != 401:
            await self.identify()  # refused before authentication (405, 413): whose was it?
        return end_failed(record, exc, http_status=self.sent_status, sample_refusals=True)

    async def send_late_error(self, error: AnthropicError) -> None:
        """End a response that has already started (a consumer that streams overrides this)."""
        await self.send_body(b"", more_body=False)

    # --- authentication --------------------------------------------------------------------------

    async def authenticate(self) -> Principal:
        """The request's key (`AuthenticationFailed` without a valid one); names the audit row's key."""
        # Every header, not `request_headers` (a dict: the last of two x-api-key would win).
        try:
            key = key_from_headers(self.scope.get("headers") or ())
        except CredentialError as exc:
            raise AuthenticationFailed(str(exc)) from None
        if not key:
            raise AuthenticationFailed(MISSING_KEY)
        principal = await key_cache.authenticate(key)
        if principal is None:
            raise AuthenticationFailed(INVALID_KEY)
        self.record.api_key_name, self.record.api_key_id = principal.name, principal.key_id or None
        return principal

    async def identify(self) -> None:
        """Name the key of a request refused before authentication (a 405, a 413), if it has a
        valid one, so that its audit row is attributed (and not sampled as anonymous)."""
        try:
            key = key_from_headers(self.scope.get("headers") or ())
        except CredentialError:
            return
        if not key:
            return
        try:
            principal = await key_cache.authenticate(key)
        except Exception:
            logger.warning("API key lookup failed while answering an error", exc_info=True)
            return
        if principal is not None:
            self.record.api_key_name, self.record.api_key_id = principal.name, principal.key_id or None

    # --- JSON replies ----------------------------------------------------------------------------

    def response_headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", content_type), (b"request-id", self.record.request_id.encode()), *self.extra_headers]

    async def send_json(self, status: int, data: Any, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
        self.state = ResponseState.REPLYING
        self.sent_status = status
        await self.send_response(
            status,
            orjson.dumps(data),
            headers=self.response_headers(b"application/json") + list(extra_headers),
        )

    async def send_error(self, error: AnthropicError) -> None:
        headers: list[tuple[bytes, bytes]] = list(error.headers)
        if error.retry_after is not None:
            headers.append((b"retry-after", str(max(1, round(error.retry_after))).encode()))
        await self.send_json(error.status, error.body(self.record.request_id), headers)
