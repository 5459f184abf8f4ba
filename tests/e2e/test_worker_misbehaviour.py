"""The gateway never hangs, never leaks and never trusts a worker blindly: every misbehaviour of
tests/support/badworker.py (a real process registered as the pool's context and generation worker) ends,
inside its deadline plus a margin, with an HTTP error in Anthropic's envelope (non-streamed, or
streamed before the status line) or an `event: error` and a closed connection (streamed, after
the status line) — and nothing the client receives names a worker's address, a path, a traceback
or a credential. The audit row ends terminal, the reservations are released, and the gateway
closes every connection it opened to the worker.

One gateway serves the whole module, with short deadlines (ENV). A failure message says which
promise broke: "silent" (the stream neither ended nor errored in time), "leak", "shape"...
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import pairwise
from typing import Any

import pytest

from tests.support.badworker import (
    CONTEXT_MODES,
    LEAK_MARKERS,
    STARTED_PAUSE_S,
    WRONG_SHAPE_CHUNKS,
    RunningBadWorker,
    marker,
    start_badworker,
)
from tests.support.cluster import audit_row, reservations_closed, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.rawclient import Frame, RawStream, parse_frame

CONTEXT_TIMEOUT_S = 1.0
FIRST_BYTE_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 1.0
REQUEST_DEADLINE_S = 4.0
PING_INTERVAL_S = 0.5
# Slack for a shared 2-core machine: process scheduling, daphne, the audit writer.
MARGIN_S = 2.0

ENV = {
    "WORKER_CONTEXT_TIMEOUT_S": str(CONTEXT_TIMEOUT_S),
    "WORKER_FIRST_BYTE_TIMEOUT_S": str(FIRST_BYTE_TIMEOUT_S),
    "WORKER_IDLE_TIMEOUT_S": str(IDLE_TIMEOUT_S),
    "MESSAGES_REQUEST_DEADLINE_S": str(REQUEST_DEADLINE_S),
    "WORKER_MAX_SSE_LINE_BYTES": str(64 * 1024),
    "WORKER_MAX_JSON_BYTES": str(1024 * 1024),
    "WORKER_MAX_RESPONSE_HEADERS": "100",
    "WORKER_MAX_RESPONSE_HEADER_BYTES": str(64 * 1024),
    "MESSAGES_PING_INTERVAL_S": str(PING_INTERVAL_S),
    # Each test has a fresh pool; a breaker opened by the previous case must not answer this one.
    "BREAKER_FAILURE_THRESHOLD": "1000000",
}

MODEL = "bad-model"
TIMEOUT = "timeout_error"
API = "api_error"
WORKER_FAILED = frozenset({"api_error", "overloaded_error"})
STATUS_FOR = {TIMEOUT: 504, API: 502}


@dataclass(frozen=True)
class Case:
    """A misbehaviour, the error type it must end with, and by when (seconds after sending)."""

    mode: str
    error_types: frozenset[str]
    bound_s: float


def _prompt_case(mode: str, error_types: frozenset[str] = frozenset({API})) -> Case:
    """A fault the gateway can see at once: within a second of it (after the healthy start when
    it happens in the generation stream)."""
    start = 0.0 if mode in CONTEXT_MODES else STARTED_PAUSE_S
    return Case(mode, error_types, start + 1.0)


CASES = [
    # issue 9 item 1: valid JSON of the wrong shape after the stream started
    *(_prompt_case(mode) for mode in WRONG_SHAPE_CHUNKS),
    _prompt_case("not_sse"),
    # item 3: no overall deadline — silence and trickles, per phase
    Case("context_hang", frozenset({TIMEOUT}), CONTEXT_TIMEOUT_S),
    Case("context_trickle_headers", frozenset({TIMEOUT}), CONTEXT_TIMEOUT_S),
    Case("context_trickle_json", frozenset({TIMEOUT}), CONTEXT_TIMEOUT_S),
    Case("generation_hang", frozenset({TIMEOUT}), FIRST_BYTE_TIMEOUT_S),
    Case("trickle_headers", frozenset({TIMEOUT}), FIRST_BYTE_TIMEOUT_S),
    Case("trickle_sse", frozenset({TIMEOUT}), STARTED_PAUSE_S + IDLE_TIMEOUT_S),
    Case("idle_mid_stream", frozenset({TIMEOUT}), STARTED_PAUSE_S + IDLE_TIMEOUT_S),
    # item 4: output without bounds, leaky errors, a context answer of the wrong shape
    _prompt_case("huge_line"),
    _prompt_case("many_headers"),
    _prompt_case("context_many_headers"),
    _prompt_case("context_huge_json"),
    _prompt_case("context_not_json"),
    _prompt_case("context_oops"),
    _prompt_case("error_body", WORKER_FAILED),
    _prompt_case("context_error_body", WORKER_FAILED),
    _prompt_case("error_frame", WORKER_FAILED),
    # connections that die (a worker gone may read as overloaded: 503)
    _prompt_case("drop_mid_stream", WORKER_FAILED),
    _prompt_case("context_drop", WORKER_FAILED),
]
# The generation-first schedule opens both requests at once: its own paths for hangs and drops.
GENERATION_FIRST_MODES = {
    "context_hang", "generation_hang", "context_drop", "drop_mid_stream", "context_error_body", "choices_null_item", "idle_mid_stream"
}

_ADDRESS = re.compile(rb"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\[[0-9a-f:]+\]:\d+|localhost:\d+", re.I)
_PATH = re.compile(rb"(?:^|[\s\"'(=])/(?:opt|usr|home|root|var|tmp|etc|work|srv|app)/", re.M)
# A credential-looking value: a key, token or password that is not a `<placeholder>`.
_CREDENTIAL = re.compile(
    rb"sk-[A-Za-z0-9_-]{6,}|(?:api[_-]?key|token|password|secret)\s*[=:]\s*(?!<)[^\s<>\"',;)]{4,}|bearer\s+(?!<)[A-Za-z0-9._-]{8,}", re.I
)
_TRACEBACK = re.compile(rb"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+")


def internal_details(wire: bytes, worker: RunningBadWorker) -> list[str]:
    """Everything in `wire` that a client must never see."""
    found = [m for m in LEAK_MARKERS if m.encode() in wire]
    found += [worker.url] if worker.url.encode() in wire else []
    for pattern in (_ADDRESS, _PATH, _CREDENTIAL, _TRACEBACK):
        found += [m.group(0).decode(errors="replace") for m in pattern.finditer(wire)]
    return found


class RecordingStream(RawStream):
    """RawStream that keeps every body byte it received and counts frames it could not parse
    (a malformed frame is a finding here, not a crash of the test)."""

    wire: bytearray
    malformed: list[bytes]

    def __post_init__(self) -> None:
        self.wire = bytearray()
        self.malformed = []
        self._kept = 0
        super().__post_init__()

    def _parse_frames(self) -> None:
        self.wire += self._buffer[self._kept :]
        if self.response_headers.get("content-type", "").startswith("text/event-stream"):
            while b"\n\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n\n", 1)
                self._frame(raw)
        self._kept = len(self._buffer)

    def _frame(self, raw: bytes) -> None:
        try:
            parsed = parse_frame(raw)
        except ValueError:
            self.malformed.append(raw)
            return
        if parsed is not None:
            self.frames.append(Frame(*parsed, self.elapsed()))

    def read_to_end(self, deadline_s: float) -> None:
        """Read until the server ends the response or `deadline_s` after sending."""
        deadline = self.sent_at + deadline_s
        while not self.ended and time.monotonic() < deadline:
            self._pump(deadline)

    def head_bytes(self) -> bytes:
        return "\n".join(f"{k}: {v}" for k, v in self.response_headers.items()).encode()


@dataclass
class BadPool:
    pool: Any
    key: str
    model: str

    def headers(self) -> dict[str, str]:
        return {"x-api-key": self.key, "anthropic-version": "2023-06-01", "content-type": "application/json"}


@pytest.fixture(scope="module")
def bad_worker() -> Iterator[RunningBadWorker]:
    worker = start_badworker()
    yield worker
    worker.stop()


@pytest.fixture
def bad_gateway(gateways: Callable[..., Gateway]) -> Gateway:
    return gateways(**ENV)


def register_bad_pool(gateway: Gateway, worker: RunningBadWorker, schedule_style: str) -> BadPool:
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(name=f"pool-{MODEL}", model=MODEL, schedule_style=schedule_style)
    WorkerEndpoint.objects.create(pool=pool, role="context", url=worker.url)
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=worker.url)
    _, key = create_api_key(f"bad-key-{time.monotonic_ns()}")
    bad = BadPool(pool, key, MODEL)
    wait_registered(gateway, bad)  # type: ignore[arg-type]  # only `.pool` is read
    return bad


def send(gateway: Gateway, pool: BadPool, mode: str, tag: str, *, stream: bool) -> RecordingStream:
    payload = {
        "model": pool.model,
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": f"misbehave {marker(mode, tag)}"}],
    }
    return RecordingStream(gateway.url + "/v1/messages", json.dumps(payload).encode(), pool.headers())


def request_id_of(s: RecordingStream, since: datetime) -> str:
    if "request-id" in s.response_headers:
        return s.response_headers["request-id"]
    from messages_api.models import MessageRequest

    rid: str = wait_until(
        lambda: MessageRequest.objects.filter(received_at__gte=since, model=MODEL).values_list("request_id", flat=True).first(),
        message="no audit row for the request",
    )
    return rid


def assert_error_envelope(body: Any, error_types: frozenset[str]) -> None:
    assert isinstance(body, dict) and body.get("type") == "error", f"shape: not Anthropic's envelope: {body!r}"
    error = body.get("error")
    assert isinstance(error, dict) and isinstance(error.get("message"), str), f"shape: {body!r}"
    assert error.get("type") in error_types, f"error type {error.get('type')!r}, expected one of {sorted(error_types)}"


def check_http_error(s: RecordingStream, case: Case) -> None:
    assert s.status is not None and s.status >= 500, f"status {s.status} for a worker failure"
    if len(case.error_types) == 1:  # a deadline is 504, a malformed answer 502
        expected = STATUS_FOR[next(iter(case.error_types))]
        assert s.status == expected, f"status {s.status}, expected {expected}"
    body = json.loads(bytes(s.wire))
    assert_error_envelope(body, case.error_types)
    assert str(body.get("request_id", "")).startswith("req_"), f"no request_id in {body!r}"


def check_stream(s: RecordingStream, case: Case) -> None:
    events = s.events()
    assert s.ended, f"silent: the stream did not end within {case.bound_s + MARGIN_S:.1f}s; events: {events}"
    assert not s.malformed, f"malformed SSE frames: {s.malformed!r}"
    assert events and events[-1] == "error", f"the stream ended without an error event: {events}"
    assert "message_stop" not in events, f"message_stop on a broken stream: {events}"
    assert_error_envelope(s.frames[-1].data, case.error_types)
    text_deltas = [f.data["delta"] for f in s.frames if f.event == "content_block_delta" and f.data["delta"].get("type") == "text_delta"]
    assert all(isinstance(d.get("text"), str) for d in text_deltas), f"a text_delta whose text is not a string: {text_deltas}"
    # Never silent while it lasted: a ping (or an event) at least every interval.
    moments = [s.head_at or 0.0, *(f.at for f in s.frames)]
    gaps = [b - a for a, b in pairwise(moments)]
    assert max(gaps, default=0.0) <= PING_INTERVAL_S + MARGIN_S, f"silent for {max(gaps):.1f}s: {events}"


def run_case(gateway: Gateway, worker: RunningBadWorker, case: Case, *, stream: bool, schedule_style: str) -> None:
    pool = register_bad_pool(gateway, worker, schedule_style)
    tag = uuid.uuid4().hex[:12]
    since = datetime.now(timezone.utc)
    s = send(gateway, pool, case.mode, tag, stream=stream)
    limit = case.bound_s + MARGIN_S
    try:
        s.read_to_end(limit)
        took = s.elapsed()
        wire = s.head_bytes() + b"\n" + bytes(s.wire)
    finally:
        s.close()
    assert s.status is not None, f"hang: no response head within {limit:.1f}s"
    leaks = internal_details(wire, worker)
    assert not leaks, f"leak: the client saw internal details {leaks}: {wire[-2000:]!r}"
    if stream and s.status == 200:
        check_stream(s, case)
    else:
        assert s.ended, f"hang: the {s.status} answer did not end within {limit:.1f}s"
        check_http_error(s, case)
    assert took <= limit, f"hang: ended after {took:.1f}s, deadline {case.bound_s:.1f}s + {MARGIN_S}s"

    request_id = request_id_of(s, since)

    row = audit_row(request_id)
    assert row.status == "failed", f"audit row {row.status}/{row.http_status}, expected failed"
    # The row records what the client saw: the status line it got, and the error's type.
    assert row.http_status == s.status, f"audit http_status {row.http_status}, the client got {s.status}"
    assert row.error_type in case.error_types, f"audit error_type {row.error_type!r}"
    assert "sk-internal-123" not in (row.error_message or ""), f"a credential in the audit row: {row.error_message!r}"
    outcomes = {r.stage: r.outcome for r in reservations_closed(request_id)}
    faulty = "context" if case.mode in CONTEXT_MODES else "generation"
    if faulty in outcomes:  # a context phase that failed before its reservation has none
        assert outcomes[faulty] == "failure", f"reservations released as {outcomes}"
    worker.wait_for(lambda stats: stats["active_tags"].get(tag, 0) == 0, timeout=5.0)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
@pytest.mark.parametrize("case", CASES, ids=[c.mode for c in CASES])
def test_misbehaving_worker_context_first(bad_gateway: Gateway, bad_worker: RunningBadWorker, case: Case, stream: bool) -> None:
    run_case(bad_gateway, bad_worker, case, stream=stream, schedule_style="context_first")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
@pytest.mark.parametrize("case", [c for c in CASES if c.mode in GENERATION_FIRST_MODES], ids=lambda c: c.mode)
def test_misbehaving_worker_generation_first(bad_gateway: Gateway, bad_worker: RunningBadWorker, case: Case, stream: bool) -> None:
    if case.mode == "generation_hang":
        # Generation first: the generation worker may rightly be silent while the context phase
        # runs, so its first-byte deadline counts from the end of that phase's own deadline.
        case = Case(case.mode, case.error_types, CONTEXT_TIMEOUT_S + FIRST_BYTE_TIMEOUT_S)
    run_case(bad_gateway, bad_worker, case, stream=stream, schedule_style="generation_first")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
def test_a_healthy_answer_from_the_same_worker_passes(bad_gateway: Gateway, bad_worker: RunningBadWorker, stream: bool) -> None:
    """The control: without a marker the bad worker is a valid TensorRT-LLM pair, so every
    failure above is the misbehaviour's, not the harness's."""
    pool = register_bad_pool(bad_gateway, bad_worker, "context_first")
    s = send(bad_gateway, pool, "healthy", uuid.uuid4().hex[:12], stream=stream)
    try:
        s.read_to_end(10)
    finally:
        s.close()
    assert s.status == 200 and s.ended
    if stream:
        events = [e for e in s.events() if e != "ping"]
        assert events[0] == "message_start" and events[-1] == "message_stop", events
        text = "".join(f.data["delta"]["text"] for f in s.frames if f.event == "content_block_delta")
    else:
        text = json.loads(bytes(s.wire))["content"][0]["text"]
    assert text == "All is well"
