"""What a Messages request is served by: the pool for its model, its session (for affinity), and
the id of the message it answers with."""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson

from messages_api.auth import Principal
from messages_api.errors import NotFound
from workers import PoolInfo, choose_pool, get_registry


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


_SESSION_IN_USER_ID = re.compile(r"session_([0-9A-Za-z-]+)")


def session_key(headers: dict[bytes, bytes], request: dict[str, Any]) -> str | None:
    """Claude Code's session id (header, or inside `metadata.user_id`), for session affinity."""
    header = headers.get(b"x-claude-code-session-id")
    if header:
        return header.decode("latin-1")
    user_id = (request.get("metadata") or {}).get("user_id")
    if not isinstance(user_id, str) or not user_id:
        return None
    # Claude Code 2.1 sends a JSON object as a string ({"device_id", "account_uuid",
    # "session_id"}); earlier versions `user_<hash>_account_<uuid>_session_<uuid>`.
    try:
        decoded = orjson.loads(user_id)
    except orjson.JSONDecodeError:
        decoded = None
    session_id = decoded.get("session_id") if isinstance(decoded, dict) else None
    if isinstance(session_id, str) and session_id:
        return session_id
    match = _SESSION_IN_USER_ID.search(user_id)
    return match.group(1) if match else user_id


async def pool_for_model(model: str, principal: Principal, chat: dict[str, Any]) -> PoolInfo:
    """The pool to serve `model` (the first of its pools with room: spill-over), with the chat
    request renamed to the model its workers know. A model the key may not use is as unknown to
    it as a missing one: `NotFound`."""
    snapshot = await get_registry().snapshot()
    served = snapshot.serving(model) if principal.may_use(model) else ()
    if not served:
        raise NotFound(f"model: {model}")
    choice = choose_pool(served) if len(served) > 1 else served[0]
    chat["model"] = choice.upstream_model
    return choice.pool
