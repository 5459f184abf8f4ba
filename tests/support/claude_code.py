"""Running the real Claude Code CLI (`claude -p`) against a gateway, in a clean environment, and
capturing what it sends (`capture_claude_code_request`: a local recorder answering as the API would)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateway import PROJECT_ROOT
from tests.support.scripted import Request as ScriptedRequest
from tests.support.scripted import ScriptedServer, answering, response

# Which installed release the tests run: an npm prefix, relative to the project unless absolute.
# CI installs the pinned release (.ci/claude-code-version) in .ci/node, and the newest published one
# in .ci/node-latest to run the same tests against it (CLAUDE_CODE_PREFIX=.ci/node-latest); bench/
# claude_code_releases.py points it at a scratch prefix per release. Read at each call, not at import.
PREFIX_VARIABLE = "CLAUDE_CODE_PREFIX"
DEFAULT_PREFIX = ".ci/node"
CLAUDE_TIMEOUT_S = 120


def claude_prefix() -> Path:
    """The npm prefix Claude Code is installed in: $CLAUDE_CODE_PREFIX, default .ci/node."""
    prefix = Path(os.environ.get(PREFIX_VARIABLE) or DEFAULT_PREFIX)
    return prefix if prefix.is_absolute() else PROJECT_ROOT / prefix


def claude_bin() -> Path:
    return claude_prefix() / "node_modules" / ".bin" / "claude"


def claude_package() -> Path:
    return claude_prefix() / "node_modules" / "@anthropic-ai" / "claude-code"


def claude_version() -> str | None:
    """The installed release's version (its package.json), None when none is installed there."""
    try:
        return str(json.loads((claude_package() / "package.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def _shown(path: Path) -> str:
    return str(path.relative_to(PROJECT_ROOT)) if path.is_relative_to(PROJECT_ROOT) else str(path)


def claude_command() -> list[str]:
    """The CLI to run; skips (or fails, with REQUIRE_CLAUDE_CODE=1) when it is not installed."""
    binary = claude_bin()
    if not binary.exists():
        hint = f"npm install --prefix {_shown(claude_prefix())} @anthropic-ai/claude-code"
        message = f"Claude Code is not installed at {_shown(binary)} (CI runs `{hint}`; {PREFIX_VARIABLE} chooses the prefix)"
        if os.environ.get("REQUIRE_CLAUDE_CODE"):
            pytest.fail(message)
        pytest.skip(message)
    # When npm did not run the package's postinstall, bin/claude.exe is a small placeholder and
    # the package's documented fallback is `node cli-wrapper.cjs`.
    wrapper = claude_package() / "cli-wrapper.cjs"
    if binary.resolve().stat().st_size < 4096 and wrapper.exists() and shutil.which("node"):
        return ["node", str(wrapper)]
    return [str(binary)]


def claude_env(
    base_url: str, key: str, home: Path, credential: str = "ANTHROPIC_API_KEY", model: str | None = "sim-model", **extra: str
) -> dict[str, str]:
    """A clean environment: no proxies, no inherited Anthropic/Claude settings, a fresh HOME;
    every model alias names `model` (None: no model variable at all, as a user who sets none);
    `extra` adds variables (e.g. CLAUDE_CODE_MAX_OUTPUT_TOKENS); one given as "" is removed."""

    def inherited(name: str) -> bool:
        upper = name.upper()
        return not (
            upper.endswith("_PROXY")
            or upper.startswith(("ANTHROPIC_", "CLAUDE_", "CLAUDECODE"))
            or upper in ("DISABLE_TELEMETRY", "DISABLE_AUTOUPDATER")
        )

    env = {name: value for name, value in os.environ.items() if inherited(name)}
    env.update(
        HOME=str(home),
        ANTHROPIC_BASE_URL=base_url,
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )
    if model is not None:
        for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL"):
            env[name] = model
    env[credential] = key  # ANTHROPIC_API_KEY → x-api-key; ANTHROPIC_AUTH_TOKEN → Authorization: Bearer
    env.update(extra)
    return {name: value for name, value in env.items() if value != ""}


def run_claude(
    base_url: str,
    key: str,
    prompt: str,
    workdir: Path,
    *extra: str,
    credential: str = "ANTHROPIC_API_KEY",
    model: str | None = "sim-model",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`claude -p PROMPT --output-format json`; in print mode no approval of the key is asked for."""
    home = workdir / "home"
    cwd = workdir / "project"
    home.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [*claude_command(), "-p", prompt, "--output-format", "json", *extra],
        env=claude_env(base_url, key, home, credential, model, **(env or {})),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=False,
        text=True,
        timeout=CLAUDE_TIMEOUT_S,
    )


# --- capturing what Claude Code sends --------------------------------------------------------------

# Connection-bound headers are not kept in the fixture; credentials never are.
UNSAVED_HEADERS = {"x-api-key", "authorization", "host", "content-length"}


def _canned_stream(text: str) -> bytes:
    events = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_capture",
                "type": "message",
                "role": "assistant",
                "model": "sim-model",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 10, "output_tokens": 1},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 2}},
        {"type": "message_stop"},
    ]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def _record_and_answer(captured: list[dict[str, Any]], request: ScriptedRequest) -> bytes:
    """Records the request in `captured`; answers like the API would (a canned text reply)."""
    if request.method not in ("HEAD", "GET", "POST"):
        return response(501)  # unrecorded, as http.server answered a method it had no handler for
    body: Any = None
    if request.method == "POST":
        try:
            body = json.loads(request.body)
        except ValueError:
            body = request.body.decode(errors="replace")
    captured.append({"method": request.method, "path": request.path, "headers": dict(request.fields), "body": body})
    api_headers = {"request-id": "req_capture"}
    if request.method == "HEAD":
        return response(200)
    if request.method == "GET":
        payload: dict[str, Any] = {"data": [], "has_more": False, "first_id": None, "last_id": None}
    elif request.path.startswith("/v1/messages/count_tokens"):
        payload = {"input_tokens": 10}
    elif isinstance(body, dict) and body.get("stream"):
        return response(200, _canned_stream("captured"), content_type="text/event-stream", headers=api_headers)
    else:
        payload = {
            "id": "msg_capture",
            "type": "message",
            "role": "assistant",
            "model": "sim-model",
            "content": [{"type": "text", "text": "captured"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 2},
        }
    return response(200, json.dumps(payload).encode(), content_type="application/json", headers=api_headers)


def capture_claude_code_request(prompt: str = "Say hello") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run Claude Code once against a local recorder; return its main request and all requests.

    The main request is its (first) `POST /v1/messages`, in the fixture's form: path, headers
    without credentials and connection-bound ones, and the JSON body.
    """
    captured: list[dict[str, Any]] = []
    recorder = answering(functools.partial(_record_and_answer, captured))
    with ScriptedServer(recorder) as server, tempfile.TemporaryDirectory() as workdir:
        result = run_claude(server.url, "sk-gw-capture-placeholder", prompt, Path(workdir))
    assert result.returncode == 0, f"claude exited {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    posts = [r for r in captured if r["method"] == "POST" and r["path"].split("?")[0] == "/v1/messages"]
    assert posts, f"Claude Code sent no POST /v1/messages: {[(r['method'], r['path']) for r in captured]}"
    main = posts[0]
    request = {
        "path": main["path"],
        "headers": {k: v for k, v in main["headers"].items() if k.lower() not in UNSAVED_HEADERS},
        "body": main["body"],
    }
    return request, captured
