"""The gateway enforces `max_tokens` itself, against a generation worker that ignores it: a
scripted worker that floods its stream with content (many small tokens, or fewer large or huge
chunks) until the gateway hangs up. Streamed and non-streamed, the answer stops at the limit, the
chunk that crosses it cut within itself, and ends normally with stop_reason `max_tokens`; its
output_tokens, counted from what was relayed (the worker reports none), are `max_tokens`, never
more. The worker's connection is closed, and the gateway's memory does not grow with the flood.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from messages_api.reframe import CHARS_PER_TOKEN, LONG_PIECE_ALLOWANCE
from tests.support.cluster import Cluster, audit_row, register_cluster, reservations_closed, wait_registered, wait_until
from tests.support.flooding import FloodingWorker, flood_prompt, flood_text
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "flood-model"
MAX_TOKENS = 64
# Bytes of 4-character tokens a worker floods with (about 150,000 chunks).
SMALL_FLOOD = 24_000_000


@pytest.fixture
def flooding_worker() -> Iterator[FloodingWorker]:
    with FloodingWorker() as worker:
        yield worker


def register(gateway: Gateway, context: SimWorker, generation: FloodingWorker) -> Cluster:
    """A pool whose prompts all skip the context phase, so each request goes straight to the
    flooding generation worker."""
    cluster = register_cluster(context, generation, model=MODEL, max_local_prefill_tokens=100_000)
    wait_registered(gateway, cluster)
    return cluster


def payload(chars: int, total: int, *, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    prompt = flood_prompt(chars, total)
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "messages": [{"role": "user", "content": prompt}]}


def cut_text(chars: int, max_tokens: int) -> str:
    """What the gateway relays of a flood of `chars`-character chunks (reframe.py's count): past 16
    characters a chunk is measured, and the text stops where its characters beyond the allowance
    reach max_tokens × 16, within the chunk that gets there."""
    allowed = max_tokens * CHARS_PER_TOKEN + LONG_PIECE_ALLOWANCE
    return (flood_text(chars) * (allowed // chars + 1))[:allowed]


def streamed(gateway: Gateway, cluster: Cluster, chars: int, total: int, max_tokens: int = MAX_TOKENS) -> tuple[str, dict[str, Any], str]:
    """The streamed answer's text, its message_delta and its request id, after checking that it
    ended normally: one text block, opened and closed, then message_delta and message_stop."""
    s = RawStream.post_json(gateway.url + "/v1/messages", payload(chars, total, stream=True, max_tokens=max_tokens), cluster.headers())
    frames = [f for f in s.read_all(timeout=60) if f.event != "ping"]
    assert s.status == 200 and s.ended
    events = [f.event for f in frames]
    deltas = events.count("content_block_delta")
    expected = ["message_start", "content_block_start", *["content_block_delta"] * deltas, "content_block_stop", "message_delta", "message_stop"]
    assert events == expected, events[:8]
    text = "".join(f.data["delta"]["text"] for f in frames if f.event == "content_block_delta")
    return text, frames[-2].data, s.response_headers["request-id"]


def non_streamed(gateway: Gateway, cluster: Cluster, chars: int, total: int, max_tokens: int = MAX_TOKENS) -> tuple[dict[str, Any], str]:
    """The non-streamed answer and its request id."""
    response = httpx.post(
        gateway.url + "/v1/messages", json=payload(chars, total, stream=False, max_tokens=max_tokens), headers=cluster.headers(), timeout=60
    )
    assert response.status_code == 200, response.text[:500]
    return response.json(), response.headers["request-id"]


def assert_completed_row(request_id: str, output_tokens: int) -> None:
    row = audit_row(request_id)
    assert row.status == "completed" and row.http_status == 200 and row.stage == "done", (row.status, row.stage)
    assert row.output_tokens == output_tokens
    assert {r.outcome for r in reservations_closed(request_id)} == {"success"}


# --- many small tokens: the token count ---------------------------------------------------------


def test_a_streamed_flood_of_tokens_stops_at_max_tokens(gateway: Gateway, context_worker: SimWorker, flooding_worker: FloodingWorker) -> None:
    cluster = register(gateway, context_worker, flooding_worker)
    text, delta, request_id = streamed(gateway, cluster, 4, SMALL_FLOOD)
    assert text == "tok " * MAX_TOKENS
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    # The worker reported no usage: its output is what was relayed, never 0.
    assert delta["usage"]["output_tokens"] == MAX_TOKENS
    flooding_worker.wait_for_hang_up()
    # The gateway stopped reading early (the kernel's socket buffers take a few MB meanwhile).
    assert flooding_worker.sent[-1] < SMALL_FLOOD // 2, flooding_worker.sent
    assert_completed_row(request_id, MAX_TOKENS)


def test_a_non_streamed_flood_of_tokens_stops_at_max_tokens(gateway: Gateway, context_worker: SimWorker, flooding_worker: FloodingWorker) -> None:
    cluster = register(gateway, context_worker, flooding_worker)
    message, request_id = non_streamed(gateway, cluster, 4, SMALL_FLOOD)
    assert message["content"] == [{"type": "text", "text": "tok " * MAX_TOKENS}]
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    assert message["usage"]["output_tokens"] == MAX_TOKENS
    flooding_worker.wait_for_hang_up()
    assert flooding_worker.sent[-1] < SMALL_FLOOD // 2, flooding_worker.sent
    assert_completed_row(request_id, MAX_TOKENS)


# --- larger chunks: the one that crosses the limit is cut within itself --------------------------


@pytest.mark.parametrize("max_tokens", [1, 64, 1000])
def test_a_flood_of_larger_chunks_is_cut_at_the_token(
    gateway: Gateway, context_worker: SimWorker, flooding_worker: FloodingWorker, max_tokens: int
) -> None:
    # The probe's worker: 1000-character chunks. Cut at the end of the chunk, the answers counted
    # 63, 126 and 1008 output tokens for max_tokens 1, 64 and 1000.
    cluster = register(gateway, context_worker, flooding_worker)
    # A flood far larger than the loopback socket buffers: a 4 MB one could be written whole
    # before a loaded gateway's cut, and then no hang-up is seen (it failed that way beside a
    # busy machine). The gateway hangs up after a few frames, so the size costs nothing.
    chars, total = 1000, 64_000_000
    expected = cut_text(chars, max_tokens)

    text, delta, request_id = streamed(gateway, cluster, chars, total, max_tokens)
    assert len(text) == len(expected) and text == expected
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == max_tokens
    flooding_worker.wait_for_hang_up(1)
    assert_completed_row(request_id, max_tokens)

    message, request_id = non_streamed(gateway, cluster, chars, total, max_tokens)
    assert message["content"] == [{"type": "text", "text": expected}]
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == max_tokens
    flooding_worker.wait_for_hang_up(2)
    assert_completed_row(request_id, max_tokens)


# --- a few huge chunks: the byte bound, and the gateway's memory ---------------------------------


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


@pytest.fixture
def memory_gateway(gateways: Callable[..., Gateway]) -> Gateway:
    """A gateway of this test's own (its peak memory is this test's), reading events of up to 1 MiB."""
    return gateways(WORKER_MAX_SSE_LINE_BYTES=str(1 << 20))


def test_a_flood_of_huge_chunks_stops_at_the_byte_bound_and_memory_stays_flat(
    memory_gateway: Gateway, context_worker: SimWorker, flooding_worker: FloodingWorker
) -> None:
    gateway = memory_gateway
    assert gateway.process is not None
    pid = gateway.process.pid
    cluster = register(gateway, context_worker, flooding_worker)
    huge = 256 * 1024  # characters per chunk: one chunk is far past max_tokens × 16
    total = 50_000_000
    # Warm up: connections, caches, the first request's allocations.
    non_streamed(gateway, cluster, 4, 100_000)
    rss_before, peak_before = status_kib(pid, "VmRSS"), status_kib(pid, "VmHWM")

    message, _ = non_streamed(gateway, cluster, huge, total)
    # The first chunk crosses the limit: cut within itself where the count reaches it; nothing after.
    assert message["content"] == [{"type": "text", "text": cut_text(huge, MAX_TOKENS)}]
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"]["output_tokens"] == MAX_TOKENS
    flooding_worker.wait_for_hang_up(1)

    text, delta, request_id = streamed(gateway, cluster, huge, total)
    assert text == cut_text(huge, MAX_TOKENS)
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == MAX_TOKENS
    flooding_worker.wait_for_hang_up(2)
    assert_completed_row(request_id, MAX_TOKENS)
    # Each flood was cut long before its end (the kernel's socket buffers take a few MB meanwhile).
    assert all(sent < total // 4 for sent in flooding_worker.sent[-2:]), flooding_worker.sent

    # Neither the peak nor what is left grew by the flood.
    wait_until(lambda: status_kib(pid, "VmRSS") - rss_before < 32 * 1024, timeout=10,
               message=f"RSS {rss_before // 1024} → {status_kib(pid, 'VmRSS') // 1024} MiB")
    peak = status_kib(pid, "VmHWM")
    assert peak - peak_before < 32 * 1024, f"peak RSS {peak_before // 1024} → {peak // 1024} MiB"
