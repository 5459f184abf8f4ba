"""The Message Batches API's shapes, without the database: the create body checked whole, the
batch object, the list's paging query, the deleted answer.

A create body is refused whole (400, before anything runs) for: no requests or more than
BATCH_MAX_REQUESTS; an item that is not `{custom_id, params}`; a `custom_id` outside
`^[a-zA-Z0-9_-]{1,64}$` or the same one twice; `params` the `/v1/messages` validator or converter
refuses, or that ask for a stream; a model the key may not use. Every message names the item by
its index (`requests.3.params.max_tokens: ...`), as the real API does.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import orjson
from django.conf import settings

from messages_api.convert import to_chat_request
from messages_api.errors import AnthropicError, InvalidRequest
from messages_api.validation import validate_messages_request

__all__ = [
    "batch_object",
    "BatchView",
    "deleted_object",
    "ItemSpec",
    "new_batch_id",
    "page_query",
    "PageQuery",
    "parse_create_body",
    "results_path",
    "rfc3339",
]

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # whole: fullmatch (`$` would let a final newline through)
_ID_ALPHABET = string.ascii_letters + string.digits


def new_batch_id() -> str:
    """`msgbatch_` and 24 random base-62 characters, as the real API's ids look."""
    return "msgbatch_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ItemSpec:
    """One checked request of a create body: its id, its params as JSON (what the runner answers)."""

    custom_id: str
    params: bytes


def parse_create_body(body: bytes, may_use: Callable[[str], bool]) -> list[ItemSpec]:
    """The items of a `POST /v1/messages/batches` body, or the 400 that refuses it whole.
    `may_use(model)` says whether the creating key may use a model."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("The request body must be a JSON object")
    if "requests" not in parsed:
        raise InvalidRequest("requests: Field required")
    requests = parsed["requests"]
    if not isinstance(requests, list):
        raise InvalidRequest("requests: Input should be a valid list")
    if not requests:
        raise InvalidRequest("requests: List should have at least 1 item after validation, not 0")
    limit = settings.BATCH_MAX_REQUESTS
    if len(requests) > limit:
        raise InvalidRequest(f"requests: List should have at most {limit} items after validation, not {len(requests)}")
    seen: set[str] = set()
    items: list[ItemSpec] = []
    for index, item in enumerate(requests):
        path = f"requests.{index}"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{path}: Input should be a valid dictionary")
        custom_id = item.get("custom_id")
        if custom_id is None:
            raise InvalidRequest(f"{path}.custom_id: Field required")
        if not isinstance(custom_id, str):
            raise InvalidRequest(f"{path}.custom_id: Input should be a valid string")
        if not CUSTOM_ID.fullmatch(custom_id):
            raise InvalidRequest(f"{path}.custom_id: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'")
        if custom_id in seen:
            raise InvalidRequest(f"{path}.custom_id: Duplicate custom_id '{custom_id}': each must be unique within the batch")
        seen.add(custom_id)
        if "params" not in item:
            raise InvalidRequest(f"{path}.params: Field required")
        params = item["params"]
        _check_params(params, f"{path}.params", may_use)
        items.append(ItemSpec(custom_id, orjson.dumps(params)))
    return items


def _check_params(params: object, path: str, may_use: Callable[[str], bool]) -> None:
    """The item's params as `POST /v1/messages` would check them (validator, then converter)."""
    try:
        request = validate_messages_request(params)
        if request.get("stream") is not None and request["stream"] is not False:
            raise InvalidRequest("stream: Streaming is not supported in a Message Batch")
        to_chat_request(request)
    except AnthropicError as exc:
        raise InvalidRequest(f"{path}.{exc.message}") from None
    model = request["model"]
    if not may_use(model):
        raise InvalidRequest(f"{path}.model: this API key may not use the model '{model}'")


def rfc3339(moment: datetime | None) -> str | None:
    """An aware datetime as the API writes it: UTC, microseconds, `Z`."""
    if moment is None:
        return None
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def results_path(batch_id: str) -> str:
    """The results' URL: a path, which the SDK joins to its own base URL (the gateway cannot know
    the scheme and host a client reached it by, behind a proxy)."""
    return f"/v1/messages/batches/{batch_id}/results"


@dataclass(frozen=True, slots=True)
class BatchView:
    """What the batch object is made of (a `MessageBatch` row's fields)."""

    batch_id: str
    processing_status: str
    created_at: datetime
    expires_at: datetime
    ended_at: datetime | None
    cancel_initiated_at: datetime | None
    archived_at: datetime | None
    total: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


def batch_object(batch: BatchView) -> dict[str, Any]:
    """Anthropic's `MessageBatch`. Every request counts as `processing` until the batch has ended
    (the documented semantics: the other counts are zero until then, and they always sum to the
    batch's size); `results_url` is set once it has ended, and not after its results are archived."""
    ended = batch.processing_status == "ended"
    counts = {
        "processing": 0 if ended else batch.total,
        "succeeded": batch.succeeded if ended else 0,
        "errored": batch.errored if ended else 0,
        "canceled": batch.canceled if ended else 0,
        "expired": batch.expired if ended else 0,
    }
    return {
        "id": batch.batch_id,
        "type": "message_batch",
        "processing_status": batch.processing_status,
        "request_counts": counts,
        "ended_at": rfc3339(batch.ended_at),
        "created_at": rfc3339(batch.created_at),
        "expires_at": rfc3339(batch.expires_at),
        "archived_at": rfc3339(batch.archived_at),
        "cancel_initiated_at": rfc3339(batch.cancel_initiated_at),
        "results_url": results_path(batch.batch_id) if ended and batch.archived_at is None else None,
    }


def deleted_object(batch_id: str) -> dict[str, Any]:
    return {"id": batch_id, "type": "message_batch_deleted"}


@dataclass(frozen=True, slots=True)
class PageQuery:
    """The list's query: at most `limit` batches after `after_id` (older) or before `before_id`
    (newer), newest first."""

    limit: int = 20
    after_id: str | None = None
    before_id: str | None = None


def page_query(query: dict[str, list[str]]) -> PageQuery:
    """`limit` (1–1000, default 20), and at most one of `after_id` / `before_id`."""
    raw = query.get("limit", ["20"])[0]
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidRequest("limit: Input should be a valid integer") from None
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit: Input should be between 1 and 1000")
    after_id = query.get("after_id", [""])[0] or None
    before_id = query.get("before_id", [""])[0] or None
    if after_id is not None and before_id is not None:
        raise InvalidRequest("Only one of after_id and before_id may be given")
    return PageQuery(limit, after_id, before_id)
