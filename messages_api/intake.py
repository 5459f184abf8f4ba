"""A request body to the validated request and its OpenAI chat, with bounded work: no key can
hold the event loop for the others.

Small bodies (below `MESSAGES_OFFLOAD_BYTES`) are parsed, validated and converted in place: a
thread hop would cost more than the work. Larger ones go to a thread of their own, one at a time:
the Python steps (validation, conversion) yield the interpreter to the event loop every few
milliseconds (`sys.getswitchinterval`), so other streams and `/health` go on meanwhile, and the
large requests of every key wait for each other rather than stack up in memory. Before parsing,
the raw body's objects are counted (`{"` cannot occur inside a JSON string, where a quote is
escaped), so a body of a million tiny content blocks is refused without building them; after
parsing, validation bounds messages and content blocks exactly (`validation.check_counts`).

When a large request ends, the memory it took is given back (`server.memory.trim`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from django.conf import settings

from messages_api.convert import to_chat_request
from messages_api.errors import AnthropicError, invalid_request
from messages_api.server import memory
from messages_api.validation import validate_count_tokens_request, validate_messages_request

Validator = Callable[[object], dict[str, Any]]
T = TypeVar("T")

# One thread: large bodies are handled one after another.
_large_bodies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="large-bodies")


def parse_json(body: bytes) -> Any:
    limit = settings.MESSAGES_MAX_JSON_OBJECTS
    # Each object opens with the two bytes `{"`: a body of at most 2 × limit bytes cannot hold too
    # many, and is not searched (a Claude Code turn, 80-190 KB: 30-140 µs of the request's CPU).
    objects = body.count(b'{"') if len(body) > 2 * limit else 0
    if objects > limit:
        raise AnthropicError(
            413,
            f"The request body holds {objects:,} JSON objects; the limit is {limit:,}",
            "request_too_large",
        )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}") from None


def _prepare(body: bytes, validate: Validator, max_tokens: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    request = validate(parse_json(body))
    chat = to_chat_request(request if max_tokens is None else {**request, "max_tokens": max_tokens})
    return request, chat


async def _prepared(body: bytes, validate: Validator, max_tokens: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    if len(body) < settings.MESSAGES_OFFLOAD_BYTES:
        return _prepare(body, validate, max_tokens)
    return await asyncio.get_running_loop().run_in_executor(_large_bodies, _prepare, body, validate, max_tokens)


async def off_loop(body_size: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` for a request of `body_size` bytes: in place for a small one, on the large
    bodies' thread (after its parse) for a large one, whose every CPU-bound step before the
    workers (rendering the worker requests' JSON, the prompt estimate) would otherwise hold the
    loop: ~200 ms for a 32 MiB body (bench/large_requests.py)."""
    if body_size < settings.MESSAGES_OFFLOAD_BYTES:
        return work(*args)
    return await asyncio.get_running_loop().run_in_executor(_large_bodies, work, *args)


async def messages_request(body: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """`POST /v1/messages`: the validated request and its chat request for the workers."""
    return await _prepared(body, validate_messages_request)


async def count_tokens_request(body: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """`POST /v1/messages/count_tokens`: the validated request and its chat (max_tokens 1)."""
    return await _prepared(body, validate_count_tokens_request, max_tokens=1)


# How long after a large request's end its memory is given back: by then its consumer, its run
# and the body they hold are gone.
RELEASE_DELAY_S = 0.5


def release(body_size: int) -> None:
    """A request is ending: after a large one, give its memory back (on the large bodies'
    thread, once what the request held is dropped)."""
    if body_size >= settings.MESSAGES_OFFLOAD_BYTES:
        loop = asyncio.get_running_loop()
        loop.call_later(RELEASE_DELAY_S, loop.run_in_executor, _large_bodies, memory.trim)
