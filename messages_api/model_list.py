"""`/v1/models` in Anthropic's shape: one model per public name, cursor-paginated."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from messages_api.errors import InvalidRequest


def model_info(name: str, display_name: str, created_at: datetime) -> dict[str, Any]:
    return {
        "type": "model",
        "id": name,
        "display_name": display_name,
        "created_at": created_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def model_page(models: list[dict[str, Any]], query: dict[str, list[str]]) -> dict[str, Any]:
    """Anthropic's cursor pagination: `limit` (1–1000, default 20), `after_id`, `before_id`."""
    try:
        limit = int(query.get("limit", ["20"])[0])
    except ValueError:
        raise InvalidRequest("limit: Input should be a valid integer") from None
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit: Input should be between 1 and 1000")
    ids = [m["id"] for m in models]
    start, end = 0, len(models)
    if "after_id" in query and query["after_id"][0] in ids:
        start = ids.index(query["after_id"][0]) + 1
    if "before_id" in query and query["before_id"][0] in ids:
        end = ids.index(query["before_id"][0])
        start = max(start, end - limit)
    page = models[start:end][:limit]
    return {
        "data": page,
        "has_more": start + len(page) < end,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
