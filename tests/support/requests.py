"""Request bodies shaped like real clients' (Claude Code 2.1.x), for tests of the front door."""

from __future__ import annotations

from typing import Any

BILLING = "x-anthropic-billing-header: cc_version=2.1.278.e3a; cc_entrypoint=cli; cch=4f1c0;"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="

BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
    "required": ["command"],
    "additionalProperties": False,
    "$schema": "http://json-schema.org/draft-07/schema#",
}
READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}


def claude_code_body() -> dict[str, Any]:
    """A request shaped like Claude Code 2.1.x's, trimmed."""
    return {
        "model": "claude-sonnet-4-6",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": BILLING},
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"},
            },
            {
                "type": "text",
                "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>CLAUDE.md says: run pytest</system-reminder>"},
                    {"type": "text", "text": "Fix the failing test in utils.py", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Read the file first.", "signature": "EqQBCkYIBxgCKkBsig=="},
                    {"type": "redacted_thinking", "data": "EmwKAhgBEgyopaque=="},
                    {"type": "text", "text": "I'll read the file."},
                    {"type": "tool_use", "id": "toolu_01A", "name": "Read", "input": {"file_path": "/repo/utils.py"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01A",
                        "content": [{"type": "text", "text": "def add(a, b):\n    return a - b\n"}],
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_01B", "name": "Bash", "input": {"command": "pytest -q"}},
                    {"type": "tool_use", "id": "toolu_01C", "name": "Read", "input": {"file_path": "/repo/shot.png"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01B", "content": "1 failed", "is_error": True},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01C",
                        "content": [
                            {"type": "text", "text": "shot.png"},
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                        ],
                    },
                    {"type": "text", "text": "Also look at this diagram"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": PNG}},
                ],
            },
            {"role": "system", "content": "<system-reminder>utils.py was modified by the user</system-reminder>"},
            {"role": "user", "content": "continue"},
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run a shell command",
                "input_schema": BASH_SCHEMA,
                "strict": True,
                "cache_control": {"type": "ephemeral"},
            },
            {
                "name": "Read",
                "description": "Read a file",
                "input_schema": READ_SCHEMA,
                "defer_loading": False,
                "input_examples": [{"file_path": "/etc/hosts"}],
            },
            {
                "type": "custom",
                "name": "mcp__github__search",
                "description": "Search GitHub",
                "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
                "defer_loading": True,
                "eager_input_streaming": True,
            },
        ],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive", "display": "summarized"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "xhigh"},
        "metadata": {"user_id": "user_5e1f_account_77_session_abc"},
        "diagnostics": {"previous_message_id": "msg_01XYZ"},
        "service_tier": "auto",
        "cache_control": {"type": "ephemeral"},
        "betas": ["interleaved-thinking-2025-05-14"],
        "container": None,
    }
