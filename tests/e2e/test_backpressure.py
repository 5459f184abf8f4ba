"""A client that does not read holds its worker back, and one that reads nothing at all is cut.

A real daphne gateway, a generation worker that writes a stream far larger than every buffer on
the way as fast as the gateway reads it (tests/support/flooding.py), and a raw TCP client with a
4 KiB receive buffer. While the client reads nothing the worker gets to write only what the
buffers hold (the gateway's per-stream bound and the kernel's socket buffers), not the answer;
once the client reads, the stream resumes and the client gets all of it, intact. A client that
never reads, on a gateway with a short MESSAGES_CLIENT_STALL_S, is cut: the worker's connection is
closed, the client's is aborted, and the request's audit row says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.cluster import Cluster, audit_row, register_cluster, wait_registered
from tests.support.flooding import FloodingWorker, flood_frame, flood_prompt, flood_text
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker
from tests.support.waiting import poll

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "flood-model"
CHARS = 4000  # characters per content chunk: ~4 KB SSE frames
# The flood: far more than the gateway's buffer (256 KiB) and the loopback sockets' buffers (a few
# MB each way) together.
TOTAL = 64_000_000
# Far above what the flood's text counts (TOTAL / 16 characters per token): never the cut.
MAX_TOKENS = 100_000_000
RCVBUF = 4096


@pytest.fixture
def flooding_worker() -> Iterator[FloodingWorker]:
    with FloodingWorker() as worker:
        yield worker


def register(gateway: Gateway, context: SimWorker, generation: FloodingWorker) -> Cluster:
    """A pool whose prompts skip the context phase: each request goes straight to the flood."""
    cluster = register_cluster(context, generation, model=MODEL, max_local_prefill_tokens=100_000)
    wait_registered(gateway, cluster)
    return cluster


def open_slow_reader(gateway: Gateway, cluster: Cluster) -> RawStream:
    """A streamed request from a client with a 4 KiB receive buffer that has read nothing yet."""
    payload: dict[str, Any] = {
        "model": MODEL, "max_tokens": MAX_TOKENS, "stream": True,
        "messages": [{"role": "user", "content": flood_prompt(CHARS, TOTAL)}],
    }
    return RawStream.post_json(gateway.url + "/v1/messages", payload, cluster.headers(), rcvbuf=RCVBUF)


def wait_until_steady(read: Callable[[], int], *, steady_s: float = 1.5, timeout: float = 60) -> int:
    """`read()`'s value once it has not changed for `steady_s` (it only grows)."""
    value, since = read(), time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif value and time.monotonic() - since >= steady_s:
            return value
    raise AssertionError(f"still changing after {timeout} s: {value}")


def test_a_client_that_does_not_read_pauses_its_worker_and_then_gets_the_whole_answer(
    gateway: Gateway, context_worker: SimWorker, flooding_worker: FloodingWorker
) -> None:
    cluster = register(gateway, context_worker, flooding_worker)
    stream = open_slow_reader(gateway, cluster)
    try:
        # The client reads nothing: the worker writes what the buffers on the way hold, and stops.
        held = wait_until_steady(lambda: flooding_worker.sending)
        assert held < TOTAL // 4, f"the worker wrote {held} of {TOTAL} bytes to a client that read none"
        assert not flooding_worker.sent  # its request is still open, paused

        # The client reads: the stream resumes, and every chunk arrives, in order.
        frames = stream.read_all(timeout=120)
    finally:
        stream.close()
    assert stream.status == 200 and stream.ended
    assert flooding_worker.sent == [flooding_worker.sending] and flooding_worker.sending >= TOTAL
    deltas = [f.data["delta"]["text"] for f in frames if f.event == "content_block_delta"]
    expected_chunks = flooding_worker.sending // len(flood_frame(CHARS))
    assert len(deltas) == expected_chunks and all(d == flood_text(CHARS) for d in deltas)
    events = [f.event for f in frames if f.event not in ("ping", "content_block_delta")]
    assert events == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert frames[-2].data["delta"]["stop_reason"] == "end_turn"
    row = audit_row(stream.response_headers["request-id"])
    assert row.status == "completed" and row.http_status == 200


@pytest.fixture
def impatient_gateway(gateways: Callable[..., Gateway]) -> Gateway:
    """A gateway that cuts a client after 2 s of reading nothing with its buffer full."""
    return gateways(MESSAGES_CLIENT_STALL_S="2")


def test_a_client_that_reads_nothing_is_cut_and_its_row_says_why(
    impatient_gateway: Gateway, context_worker: SimWorker, flooding_worker: FloodingWorker
) -> None:
    from messages_api.models import MessageRequest

    gateway = impatient_gateway
    cluster = register(gateway, context_worker, flooding_worker)
    before = set(MessageRequest.objects.filter(model=MODEL).values_list("request_id", flat=True))
    stream = open_slow_reader(gateway, cluster)
    try:
        # Never read: the gateway cancels the worker's request (it closes the worker's connection).
        flooding_worker.wait_for_hang_up(1, timeout=60)
        assert flooding_worker.sent[-1] < TOTAL // 4, flooding_worker.sent

        # The client's connection was aborted: what it can still read is what its own buffer held.
        received = 0
        stream.sock.settimeout(30)
        while True:
            try:
                data = stream.sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += len(data)
            assert received < 4 * 1024 * 1024, "the connection goes on after the cut"
    finally:
        stream.close()

    def cut_row() -> Any:
        rows = MessageRequest.objects.filter(model=MODEL).exclude(request_id__in=before).exclude(status="in_progress")
        return rows.first()

    row = poll(cut_row, lambda found: found is not None, timeout=10, what="the cut request's audit row")
    assert row.status == "failed" and row.error_type == "timeout_error", (row.status, row.error_type)
    assert "read nothing of the stream for 2 seconds" in row.error_message, row.error_message
    assert row.http_status == 200  # the stream had started

