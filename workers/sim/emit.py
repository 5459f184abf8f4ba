"""Sending a planned Generation to the client: paced SSE, or one JSON body."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .asgi import JSON_HEADERS, SSE_HEADERS, Send
from .error_answers import SimulatedDrop
from .output import Generation
from .wire import DONE_FRAME, ChunkFramer, chat_completion


@dataclass(frozen=True, slots=True)
class EmitOptions:
    model: str
    prompt_tokens: int
    interval: float  # seconds between tokens; 0.0 = unpaced
    include_usage: bool = False
    continuous_usage: bool = False
    fail_after: int | None = None  # drop the connection after this many tokens
    first_chunk_delay: float = 0.0  # seconds between the headers and the first chunk
    # Prompt tokens the worker reused from its prefix cache; None when it has none (then usage
    # has no prompt_tokens_details, as a vLLM server's by default).
    cached_tokens: int | None = None
    # The prompt's token ids, for the first chunk (vLLM's `return_token_ids`); None: null there.
    prompt_token_ids: list[int] | None = None


# Unpaced streams write this many frames per socket write: one write per frame would make
# the simulator's syscalls, not the gateway under test, the bottleneck of a benchmark.
UNPACED_BATCH = 16
# A paced stream that fell behind (an overloaded loop) catches up at most this many at once.
CATCH_UP_BATCH = 64


async def stream(send: Send, generation: Generation, options: EmitOptions) -> None:
    """Streams one token per chunk, the first at once, then one every `interval` seconds.

    Frames that are due at the same moment (unpaced, or behind schedule) share one write;
    each frame still carries exactly one token. As in vLLM, the last token's chunk carries the
    finish reason (there is no separate empty finish chunk).
    """
    framer = ChunkFramer(
        options.model, options.prompt_tokens, continuous_usage=options.continuous_usage,
        cached_tokens=options.cached_tokens, prompt_token_ids=options.prompt_token_ids,
    )
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    if options.first_chunk_delay > 0:
        await asyncio.sleep(options.first_chunk_delay)
    await send({"type": "http.response.body", "body": framer.role(), "more_body": True})
    loop = asyncio.get_running_loop()
    interval = options.interval
    deltas = generation.deltas
    count = len(deltas)
    if options.fail_after is None:
        stop_at = max(count - 1, 0)  # the last token goes out with the finish reason
    else:
        stop_at = min(options.fail_after, count)
    start = loop.time()
    index = 0
    while index < stop_at:
        if index:
            # Sleep to an absolute schedule so pacing does not drift; sleep(0) when behind or
            # unpaced still yields, keeping thousands of streams fair and disconnects visible.
            await asyncio.sleep(max(start + index * interval - loop.time(), 0.0))
        if interval:
            due = int((loop.time() - start) / interval) + 1
            end = min(max(due, index + 1), index + CATCH_UP_BATCH, stop_at)
        else:
            end = min(index + UNPACED_BATCH, stop_at)
        frames = b"".join([framer.delta(deltas[i], i + 1) for i in range(index, end)])
        await send({"type": "http.response.body", "body": frames, "more_body": True})
        index = end
    if options.fail_after is not None:
        raise SimulatedDrop
    if index:
        await asyncio.sleep(max(start + index * interval - loop.time(), 0.0))
    tail = framer.finish(
        deltas[-1] if count else None,
        generation.finish_reason,
        generation.stop_reason,
        count,
        last=not options.include_usage,
    )
    if options.include_usage:
        tail += framer.usage(count)
    await send({"type": "http.response.body", "body": tail + DONE_FRAME, "more_body": False})


async def respond(send: Send, generation: Generation, options: EmitOptions) -> None:
    """Answers with one chat.completion after the time generating it would take."""
    if options.interval:
        await asyncio.sleep(generation.completion_tokens * options.interval)
    body = chat_completion(options.model, generation, options.prompt_tokens, options.cached_tokens)
    headers = [JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if options.fail_after is not None:
        # Half a body under a full Content-Length, then the connection goes: a torn answer.
        await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
        raise SimulatedDrop
    await send({"type": "http.response.body", "body": body})
