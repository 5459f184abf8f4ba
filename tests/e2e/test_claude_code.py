"""Claude Code against the gateway: the real CLI, and a replay of a request it really sent.

- `test_claude_code_print_mode` runs `claude -p ... --output-format json` against a real gateway
  and real sim workers, in both schedule orders (and once with ANTHROPIC_AUTH_TOKEN, the Bearer
  header, instead of ANTHROPIC_API_KEY). Claude Code is installed by CI with
  `npm install --prefix .ci/node @anthropic-ai/claude-code`; these tests skip only when that binary
  is missing (set REQUIRE_CLAUDE_CODE=1 to make a missing binary a failure instead). In print mode
  Claude Code asks no approval for the key, so nothing else is needed.
- `test_claude_code_runs_the_tool_the_sim_calls`: a two-turn agent loop (the sim calls Read, Claude
  Code runs it and sends the tool_result back).
- `test_replayed_claude_code_request_through_the_gateway` sends `fixtures/claude_code_request.json` (one request
  Claude Code 2.1.197 sent, captured with tests/support/claude_code.py's `capture_claude_code_request`) through the
  gateway with httpx, streamed and not, and checks the answer with the SDK's own types and
  stream accumulator, and what the workers were sent.
- `test_session_key_*`: the session affinity key from Claude Code's header and, without it, from
  its JSON `metadata.user_id`.
- `test_installed_claude_code_request_still_converts` captures a fresh request from the installed
  Claude Code and runs it through the gateway's validation and conversion in-process, so a
  Claude Code release that changes its request shape shows up here.

Claude Code's request is ~20k tokens for the sim's tokenizer (a 5.6k-character system prompt, two
dozen tools, a mid-conversation system message), more than the 4096-token context of the shared
sim workers in conftest, so this module starts its own pair with a larger context.

Regenerate the fixture with `.venv/bin/python -m tests.e2e.test_claude_code`.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._beta_messages import accumulate_event
from anthropic.types import Message
from anthropic.types.beta import BetaMessage, BetaRawMessageStreamEvent
from pydantic import TypeAdapter

from tests.support.claude_code import UNSAVED_HEADERS, capture_claude_code_request, claude_command, run_claude
from tests.support.cluster import (
    Cluster,
    audit_row,
    call_command_quietly,
    register_cluster,
    wait_registered,
    wait_until,
)
from tests.support.gateway import PROJECT_ROOT, Gateway
from tests.support.simworkers import SimWorker, requests_with, sim_output, start_simworker

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "claude_code_request.json"
BILLING_MARKER = "x-anthropic-billing-header:"
EVENTS = TypeAdapter(BetaRawMessageStreamEvent)


# --- running Claude Code ---------------------------------------------------------------------------


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_context_workers() -> Iterator[tuple[SimWorker, SimWorker]]:
    options = {"tokens_per_second": 2000, "prefill_tokens_per_second": 2_000_000, "max_context_tokens": 200_000, "kv_timeout": 30}
    context = start_simworker("context", **options)
    try:
        generation = start_simworker("generation", **options)
    except BaseException:
        context.stop()
        raise
    yield context, generation
    generation.stop()
    context.stop()


@pytest.fixture
def cc_cluster(
    transactional_db: Any, gateway: Gateway, large_context_workers: tuple[SimWorker, SimWorker], schedule_style: str
) -> Cluster:
    cluster = register_cluster(*large_context_workers, schedule_style=schedule_style)
    wait_registered(gateway, cluster)
    return cluster


def load_fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


# --- helpers ---------------------------------------------------------------------------------------


def assert_worker_request_is_converted(sent: dict[str, Any], original: dict[str, Any]) -> None:
    """What a worker got for Claude Code's request: no billing block, tools as OpenAI functions."""
    dumped = json.dumps(sent, ensure_ascii=False)
    assert BILLING_MARKER not in dumped
    assert "cache_control" not in dumped
    messages = sent["messages"]
    assert messages[0]["role"] == "system"
    # The first non-billing system block leads the system prompt.
    kept = [block["text"] for block in original["system"] if not block["text"].startswith(BILLING_MARKER)]
    assert messages[0]["content"].startswith(kept[0])
    assert all(text in messages[0]["content"] for text in kept)
    # Claude Code's mid-conversation `role: system` message stays where it was, after the user turn.
    roles = [m["role"] for m in messages]
    assert roles[0] == "system" and "user" in roles
    if any(m["role"] == "system" for m in original["messages"]):
        assert "system" in roles[roles.index("user") :]
    tools = sent["tools"]
    assert [t["type"] for t in tools] == ["function"] * len(original["tools"])
    assert [t["function"]["name"] for t in tools] == [t["name"] for t in original["tools"]]
    for function, tool in zip((t["function"] for t in tools), original["tools"], strict=True):
        assert function["parameters"] == tool["input_schema"]
        assert function.get("description") == tool.get("description")
        assert set(function) <= {"name", "description", "parameters"}
    assert sent["user"] == original["metadata"]["user_id"]
    assert sent["chat_template_kwargs"] == {"enable_thinking": original["thinking"]["type"] != "disabled"}


# --- the real CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule_style", "credential"),
    [
        ("context_first", "ANTHROPIC_API_KEY"),
        ("generation_first", "ANTHROPIC_API_KEY"),
        ("context_first", "ANTHROPIC_AUTH_TOKEN"),
    ],
)
def test_claude_code_print_mode(gateway: Gateway, cc_cluster: Cluster, tmp_path: Path, credential: str) -> None:
    command = claude_command()
    result = run_claude(gateway.url, cc_cluster.key, "Say hello [sim tokens=8]", tmp_path, credential=credential)
    diagnostics = f"exit {result.returncode}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
    assert result.returncode == 0, diagnostics
    output = json.loads(result.stdout)
    assert output["type"] == "result" and output["subtype"] == "success", diagnostics
    assert output["is_error"] is False, diagnostics

    # The prompt reached the generation worker; the result is exactly what the sim generated.
    generated = requests_with(cc_cluster.generation, "Say hello [sim tokens=8]")
    assert generated, f"no generation request carried the prompt; command {command}"
    expected = sim_output(generated[-1])
    assert len(expected.split()) == 8
    assert output["result"].strip() == expected
    assert output["usage"]["output_tokens"] == 8

    # Every request Claude Code made was served (and it really streamed the main one).
    from messages_api.models import MessageRequest

    wait_until(
        lambda: MessageRequest.objects.filter(stream=True, status="completed", output_tokens=8).exists(),
        message="no completed streamed audit row with the 8 tokens",
    )
    rows = [audit_row(row.request_id) for row in MessageRequest.objects.order_by("id")]
    described = [(r.status, r.http_status, r.error_type, r.finished_ms) for r in rows]
    # Claude Code retries a stream on its own (a stale kept-alive connection, its stream
    # watchdog): an attempt it abandoned ends `cancelled` (CI, once, under load: a cancelled
    # attempt, then the completed one). Nothing may fail, and the last attempt completes.
    assert all(row.status in ("completed", "cancelled") and not row.error_type for row in rows), described
    assert rows[-1].status == "completed" and sum(row.status == "cancelled" for row in rows) <= 1, described

    # What the workers got for it: the attribution block dropped, the tools as OpenAI functions.
    context_requests = requests_with(cc_cluster.context, "Say hello [sim tokens=8]")
    assert context_requests
    for sent in (context_requests[-1], generated[-1]):
        dumped = json.dumps(sent, ensure_ascii=False)
        assert BILLING_MARKER not in dumped
        assert sent["tools"] and all(t["type"] == "function" and set(t) == {"type", "function"} for t in sent["tools"])


def test_claude_code_runs_the_tool_the_sim_calls(gateway: Gateway, cc_cluster: Cluster, tmp_path: Path) -> None:
    """A whole agent turn: the sim calls Claude Code's Read tool, Claude Code reads the file and
    sends the tool_result back through the gateway, and the sim's second answer is the result.

    The sim fills each required string argument with "Paris", so the file read is ./Paris.
    """
    command = claude_command()
    marker = "gateway-tool-result-marker-7f3a"
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "Paris").write_text(f"{marker}\n")
    # --max-turns (a hidden print-mode option) bounds the loop the sim bug above causes.
    result = run_claude(gateway.url, cc_cluster.key, "Read the file [sim tool_call=Read]", tmp_path, "--max-turns", "4")
    diagnostics = f"{command} exit {result.returncode}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
    assert result.returncode == 0, diagnostics
    output = json.loads(result.stdout)
    assert output["subtype"] == "success" and output["is_error"] is False, diagnostics
    assert output["num_turns"] == 2, diagnostics

    first, second = requests_with(cc_cluster.generation, "[sim tool_call=Read]")[-2:]
    assert first["messages"][-1]["role"] != "tool"
    history = second["messages"]
    calls = [m for m in history if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(calls) == 1
    call = calls[0]["tool_calls"][0]
    assert call["function"]["name"] == "Read"
    assert json.loads(call["function"]["arguments"]) == {"file_path": "Paris"}
    results = [m for m in history if m["role"] == "tool"]
    assert len(results) == 1 and results[0]["tool_call_id"] == call["id"]
    assert marker in results[0]["content"]
    # The tool-result turn carries no directive of its own, so the sim answered with its default
    # text, which is the result Claude Code prints.
    assert output["result"].strip() == sim_output(second)


# --- the captured request, replayed ----------------------------------------------------------------


def replay_request(
    cluster: Cluster, *, stream: bool, suffix: str = " [sim tokens=5]"
) -> tuple[str, dict[str, str], dict[str, Any]]:
    fixture = load_fixture()
    body = copy.deepcopy(fixture["body"])
    body["stream"] = stream
    last_user = next(m for m in reversed(body["messages"]) if m["role"] == "user")
    if isinstance(last_user["content"], str):
        last_user["content"] += suffix
    else:
        next(b for b in reversed(last_user["content"]) if b["type"] == "text")["text"] += suffix
    headers = {
        k: v for k, v in fixture["headers"].items() if k.lower() not in UNSAVED_HEADERS | {"connection", "accept-encoding"}
    }
    headers["x-api-key"] = cluster.key
    return fixture["path"], headers, body


def read_stream(response: httpx.Response) -> list[dict[str, Any]]:
    """The SSE events, parsed by the SDK's decoder; `data.type` must match the event name."""
    events = []
    for sse in SSEDecoder().iter_bytes(response.iter_bytes()):
        data = sse.json()
        assert sse.event == data["type"], (sse.event, data)
        events.append(data)
    return events


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_replayed_claude_code_request_through_the_gateway(gateway: Gateway, cc_cluster: Cluster, stream: bool) -> None:
    path, headers, body = replay_request(cc_cluster, stream=stream)
    with httpx.Client(base_url=gateway.url, timeout=30, trust_env=False) as http:
        if stream:
            with http.stream("POST", path, headers=headers, json=body) as response:
                assert response.status_code == 200, response.read()
                assert response.headers["content-type"].startswith("text/event-stream")
                request_id = response.headers["request-id"]
                events = read_stream(response)
            kinds = [e["type"] for e in events if e["type"] != "ping"]
            assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
            assert "error" not in kinds
            snapshot = None
            json_bufs: dict[int, bytes] = {}
            for data in (e for e in events if e["type"] != "ping"):
                event = EVENTS.validate_python(data)  # each event is a valid SDK type
                snapshot = accumulate_event(
                    event=event, current_snapshot=snapshot, json_bufs=json_bufs, request_headers=httpx2.Headers(headers)
                )
            assert snapshot is not None
            message = snapshot.to_dict()
            # Pings may come first when the first token is slower than the stream's start wait.
            [start] = [e for e in events if e["type"] == "message_start"]
            assert start["message"]["usage"]["input_tokens"] > 0
        else:
            response = http.post(path, headers=headers, json=body)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/json"
            request_id = response.headers["request-id"]
            message = response.json()
    # The whole message validates as the SDK's (strict) models, beta and GA.
    beta = BetaMessage.model_validate(message)
    ga = Message.model_validate(message)
    assert ga.stop_reason == "end_turn" and ga.role == "assistant" and ga.model == body["model"]
    assert [b.type for b in ga.content] == ["text"]
    assert len(ga.content[0].text.split()) == 5
    assert ga.usage.input_tokens > 0 and ga.usage.output_tokens == 5
    assert beta.id == ga.id
    row = audit_row(request_id)
    assert row.status == "completed" and row.stream is stream

    generated = requests_with(cc_cluster.generation, "[sim tokens=5]")
    assert generated and sim_output(generated[-1]) == ga.content[0].text
    assert_worker_request_is_converted(generated[-1], body)
    context = requests_with(cc_cluster.context, "[sim tokens=5]")
    assert context
    assert_worker_request_is_converted(context[-1], body)
    assert context[-1]["disaggregated_params"]["request_type"] == "context_only"


def test_fixture_is_a_claude_code_request() -> None:
    """The fixture keeps what makes Claude Code's request Claude Code's, and no credentials."""
    fixture = load_fixture()
    assert fixture["path"] == "/v1/messages?beta=true"
    headers = {k.lower(): v for k, v in fixture["headers"].items()}
    assert not UNSAVED_HEADERS & set(headers)
    assert headers["user-agent"].startswith("claude-cli/")
    assert headers["anthropic-version"] == "2023-06-01"
    assert len(headers["anthropic-beta"].split(",")) > 3
    assert "x-claude-code-session-id" in headers
    body = fixture["body"]
    assert body["system"][0]["text"].startswith(BILLING_MARKER)
    assert body["stream"] is True and body["tools"] and body["thinking"]
    assert "user_id" in body["metadata"] and "context_management" in body
    assert any(m["role"] == "system" for m in body["messages"])


def test_session_key_from_the_claude_code_header() -> None:
    from messages_api.selection import session_key

    fixture = load_fixture()
    session = fixture["headers"]["X-Claude-Code-Session-Id"]
    assert session_key({b"x-claude-code-session-id": session.encode()}, fixture["body"]) == session


def test_session_key_from_the_claude_code_user_id() -> None:
    """Without the header, the session comes from `metadata.user_id`, which Claude Code 2.1.x sends
    as a JSON string: {"device_id": ..., "account_uuid": ..., "session_id": ...}. Every session
    mapping to the same key pins them all to one generation endpoint under session_affinity."""
    from messages_api.selection import session_key

    fixture = load_fixture()
    session = fixture["headers"]["X-Claude-Code-Session-Id"]
    assert json.loads(fixture["body"]["metadata"]["user_id"])["session_id"] == session
    assert session_key({}, fixture["body"]) == session


def test_installed_claude_code_request_still_converts() -> None:
    """Today's Claude Code request: same path, billing block first, accepted and converted."""
    claude_command()  # skips when not installed
    from messages_api.convert import BILLING_BLOCK, to_chat_request
    from messages_api.validation import validate_messages_request

    request, captured = capture_claude_code_request("Say hello")
    assert request["path"] == "/v1/messages?beta=true"
    body = request["body"]
    assert BILLING_BLOCK.fullmatch(body["system"][0]["text"]), body["system"][0]["text"]
    chat = to_chat_request(validate_messages_request(body))
    assert_worker_request_is_converted(chat, body)
    # Every route Claude Code calls is one the gateway answers (2.1.220-2.1.289 probe /api/hello).
    assert {(r["method"], r["path"].split("?")[0]) for r in captured} <= {
        ("HEAD", "/"),
        ("HEAD", "/api/hello"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/models"),
    }


if __name__ == "__main__":
    request, _ = capture_claude_code_request("Say hello")
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(request, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FIXTURE.relative_to(PROJECT_ROOT)}: {request['path']}, {len(request['body']['tools'])} tools")


# --- many tenants ------------------------------------------------------------------------------------


def test_claude_code_finishes_a_tool_task_while_another_key_floods(
    gateways: Callable[..., Gateway], large_context_workers: tuple[SimWorker, SimWorker], transactional_db: Any, tmp_path: Path
) -> None:
    """A noisy key keeps the pool's only generation slots full (and the queue long) with slow
    requests; Claude Code, on an interactive key, still completes a tool-using task: its requests
    wait only for the next slot, ahead of the flood (docs/tenancy.md)."""
    from django.core.management import call_command

    from messages_api.auth import create_api_key, hash_key
    from messages_api.models import ApiKey

    gateway = gateways(ADMISSION_QUEUE_TIMEOUT_S="20")
    cluster = register_cluster(*large_context_workers, schedule_style="generation_first", generation_capacity=2)
    wait_registered(gateway, cluster)
    call_command("key_limits", ApiKey.objects.get(key_hash=hash_key(cluster.key)).name, priority="interactive")
    _, noisy = create_api_key(f"noisy-{time.monotonic_ns()}")
    stop = threading.Event()
    statuses: list[int] = []

    def flood() -> None:
        body = {"model": cluster.model, "max_tokens": 64, "messages": [{"role": "user", "content": "flood [sim gen_delay=0.4 tokens=4]"}]}
        with httpx.Client(base_url=gateway.url, timeout=60, trust_env=False) as http:
            while not stop.is_set():
                statuses.append(http.post("/v1/messages", json=body, headers=cluster.headers(**{"x-api-key": noisy})).status_code)

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(12)]
    for thread in flooders:
        thread.start()
    try:
        wait_until(lambda: len(statuses) >= 6, timeout=20, message="the flood never got going")
        (tmp_path / "project").mkdir()
        (tmp_path / "project" / "Paris").write_text("flooded but served\n")
        result = run_claude(gateway.url, cluster.key, "Read the file [sim tool_call=Read]", tmp_path, "--max-turns", "4")
    finally:
        stop.set()
        for thread in flooders:
            thread.join(timeout=60)
    diagnostics = f"exit {result.returncode}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
    assert result.returncode == 0, diagnostics
    output = json.loads(result.stdout)
    assert output["subtype"] == "success" and output["num_turns"] == 2, diagnostics
    assert set(statuses) <= {200, 529}, sorted(set(statuses))  # the flood is served or told to come back, never a 5xx else


# --- no model variables: the gateway's catalogue ---------------------------------------------------


def test_claude_code_with_no_model_variables_uses_the_routed_claude_names_and_discovers_them(
    gateway: Gateway, cc_cluster: Cluster, tmp_path: Path
) -> None:
    """As `make run` sets it up (quickstart's routes): Claude Code with only ANTHROPIC_BASE_URL and
    a key completes a tool-using task, its background Haiku-class calls included, and with
    discovery on caches the gateway's claude-* names for its /model picker."""
    from workers.management.commands import quickstart

    for name, display_name in quickstart.CLAUDE_MODELS:
        call_command_quietly("model_route", name, pool=[cc_cluster.pool.name], display_name=display_name)
    for pattern in quickstart.CLAUDE_PATTERNS:
        call_command_quietly("model_route", pattern, pool=[cc_cluster.pool.name])
    wait_until(
        lambda: any(
            m["id"] == "claude-opus-4-8" for m in httpx.get(gateway.url + "/v1/models", headers=cc_cluster.headers(), timeout=5).json()["data"]
        ),
        message="routes never seen",
    )
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "Paris").write_text("no model variables\n")
    discovery = {"CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": ""}
    from django.utils import timezone

    started = timezone.now()
    result = run_claude(gateway.url, cc_cluster.key, "Read the file [sim tool_call=Read]", tmp_path, "--max-turns", "4", model=None, env=discovery)
    diagnostics = f"exit {result.returncode}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
    assert result.returncode == 0, diagnostics
    output = json.loads(result.stdout)
    assert output["subtype"] == "success" and output["num_turns"] == 2, diagnostics
    from messages_api.models import MessageRequest

    ours = MessageRequest.objects.filter(received_at__gte=started)  # not an earlier test's late rows
    asked = set(ours.values_list("model", flat=True))
    assert asked and all(name.startswith("claude-") for name in asked), asked
    assert not ours.filter(http_status=404).exists()
    cached = json.loads((tmp_path / "home" / ".claude" / "cache" / "gateway-models.json").read_text())
    assert cached["baseUrl"] == gateway.url
    assert {m["id"] for m in cached["models"]} >= {name for name, _ in quickstart.CLAUDE_MODELS}


@pytest.mark.parametrize(("method", "path"), [("HEAD", "/"), ("GET", "/"), ("HEAD", "/api/hello"), ("GET", "/api/hello")])
def test_the_connectivity_probes_claude_code_sends_answer_200(gateway: Gateway, method: str, path: str) -> None:
    assert httpx.request(method, gateway.url + path, timeout=10).status_code == 200
