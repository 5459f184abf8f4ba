"""Cleanups that outlive the request that started them: a run's close, and a generation request
that carries a handoff.

A client that leaves after the context worker issued its handoff must not strand the KV blocks
that handoff holds: a context worker keeps them until a generation worker takes them or its own
timeout expires (minutes: one common KV connector waits 480 s by default). So the generation
request is still dispatched, and closed as soon as its worker has taken the handoff, in a
detached task bounded by `WORKER_HANDOFF_RELEASE_TIMEOUT_S` (`release_handoff`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from django.conf import settings

from workers.wire.chat_stream import ChunkStream

logger = logging.getLogger(__name__)

# Cleanups still running after their request ended, kept so they are not collected.
_detached: set[asyncio.Task[None]] = set()


def detach(cleanup: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
    """Run a cleanup as a task that outlives whoever started it (held here until it ends: the
    loop keeps only weak references to tasks)."""
    task = asyncio.get_running_loop().create_task(cleanup, name=name)
    _detached.add(task)
    task.add_done_callback(_detached.discard)
    return task


def release_handoff(generation_open: asyncio.Task[ChunkStream]) -> None:
    """Let the generation request's worker take its handoff's KV, then close the request: in the
    background, for at most `WORKER_HANDOFF_RELEASE_TIMEOUT_S`."""
    detach(close_when_taken(generation_open, settings.WORKER_HANDOFF_RELEASE_TIMEOUT_S))


async def close_when_taken(generation_open: asyncio.Task[ChunkStream], timeout: float) -> None:
    """Give a generation request up to `timeout` to be answered (its worker has then taken any
    handoff), cancel it otherwise, and close whatever stream it opened."""
    try:
        if not generation_open.done():
            await asyncio.wait({generation_open}, timeout=timeout)
        if not generation_open.done():
            generation_open.cancel()
            await asyncio.wait({generation_open})
        if not generation_open.cancelled() and generation_open.exception() is None:
            stream = generation_open.result()
            stream.end_span("cancelled")  # traced: the call ends here, never relayed (its run ended)
            await stream.aclose()
    except Exception:  # a cleanup must never raise into the loop
        logger.exception("closing a generation request failed")


__all__ = ["close_when_taken", "detach", "release_handoff"]
