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

A body of `MESSAGES_ISOLATE_BYTES` or more goes further: to a process of its own (one, started at
the first such body). On a thread, each C call over one huge string — orjson's parse, the
rendering of the message for the workers — holds the interpreter from start to end, ~0.5 s of
`/health` waiting for a 32 MiB text (bench/large_requests.py); a process holds only its own. What
comes back (the request, its chat and their rendering) is unpickled by the executor's thread in
short copies. If that process dies, the next large body starts another, and this body is
prepared on the thread instead.

When a large request ends, the memory it took is given back (`server.memory.trim`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import orjson
from django.conf import settings

from messages_api.cache_accounting import cached_prefix_share
from messages_api.convert import to_chat_request
from messages_api.errors import InvalidRequest, RequestTooLarge
from messages_api.server import memory
from messages_api.validation import validate_count_tokens_request, validate_messages_request
from workers import RenderedChat

logger = logging.getLogger(__name__)

Validator = Callable[[object], dict[str, Any]]

# One thread: large bodies are handled one after another.
_large_bodies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="large-bodies")
# The process for the largest (started at the first one; replaced if it dies).
_isolated: ProcessPoolExecutor | None = None


def parse_json(body: bytes) -> Any:
    limit = settings.MESSAGES_MAX_JSON_OBJECTS
    # Each object opens with the two bytes `{"`: a body of at most 2 × limit bytes cannot hold too
    # many, and is not searched (a Claude Code turn, 80-190 KB: 30-140 µs of the request's CPU).
    objects = body.count(b'{"') if len(body) > 2 * limit else 0
    if objects > limit:
        raise RequestTooLarge(
            f"The request body holds {objects:,} JSON objects; the limit is {limit:,}"
        )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None


def _prepare(body: bytes, validate: Validator, max_tokens: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    request = validate(parse_json(body))
    chat = to_chat_request(request if max_tokens is None else {**request, "max_tokens": max_tokens})
    return request, chat


async def _prepared(body: bytes, validate: Validator, max_tokens: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    if len(body) < settings.MESSAGES_OFFLOAD_BYTES:
        return _prepare(body, validate, max_tokens)
    return await asyncio.get_running_loop().run_in_executor(_large_bodies, _prepare, body, validate, max_tokens)


class Prepared(NamedTuple):
    """A `POST /v1/messages` body made ready: each part is a walk over the whole body, done
    together (off the event loop for a large body)."""

    request: dict[str, Any]
    chat: dict[str, Any]
    rendered: RenderedChat
    #: The part of the body up to its last cache breakpoint (`cache_accounting`); 0 without one.
    #: Even the search for a breakpoint is a pass over the bytes: ~24 ms of a 32 MiB body.
    cache_share: float


def _prepare_message(body: bytes) -> Prepared:
    request, chat = _prepare(body, validate_messages_request, None)
    cache_share = cached_prefix_share(request, len(body)) if b'"cache_control"' in body else 0.0
    return Prepared(request, chat, RenderedChat.prepared(chat), cache_share)


def _prepare_message_isolated(body: bytes) -> Prepared:
    """In the isolated process: the same work, and its memory given back before the next body."""
    try:
        return _prepare_message(body)
    finally:
        memory.trim()


def _start_isolated() -> None:
    import django

    django.setup()


async def messages_request(body: bytes) -> Prepared:
    """`POST /v1/messages`: the validated request, its chat request for the workers, that chat
    rendered (with its prompt estimated), and its cache breakpoint's share of the body."""
    size = len(body)
    if size < settings.MESSAGES_OFFLOAD_BYTES:
        return _prepare_message(body)
    loop = asyncio.get_running_loop()
    if 0 < settings.MESSAGES_ISOLATE_BYTES <= size:
        global _isolated
        if _isolated is None:
            # spawn, not fork: daphne's threads may hold locks a forked child would inherit held.
            # A spawned child imports the launcher's main module again unless it is a package's
            # __main__ (`python -m daphne`); a launching script must guard its start with
            # `if __name__ == "__main__"`, as manage.py and pip's `daphne` script do.
            _isolated = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_isolated
            )
        try:
            return await loop.run_in_executor(_isolated, _prepare_message_isolated, body)
        except BrokenProcessPool:
            logger.error("the process that prepares large request bodies died; starting another")
            _isolated = None
    return await loop.run_in_executor(_large_bodies, _prepare_message, body)


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
