"""Running the real Claude Code CLI (`claude -p`) against a gateway, in a clean environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.gateway import PROJECT_ROOT

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
