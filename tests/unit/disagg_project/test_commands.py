"""The management commands that change keys, limits, pools, endpoints and routes each log what they
changed (logger `gateway.changes`): the command, who ran it, the old and new values, never a
secret. (Changes made in the admin are in its LogEntry history: tests/unit/disagg_project/test_admin.py.)"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

pytestmark = pytest.mark.django_db(transaction=True)


def changes(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.changes"]
    caplog.clear()
    return lines


def run(*args: Any, **options: Any) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO(), **options)
    return out.getvalue()


def test_each_command_logs_what_it_changed(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level("INFO", logger="gateway.changes")

    key = run("create_api_key", "alice").strip().splitlines()[-1]
    [created] = changes(caplog)
    assert "create_api_key by " in created and "'alice'" in created and "created" in created
    assert key not in created

    run("key_limits", "alice", "--requests-per-minute", "60", "--priority", "batch")
    [limited] = changes(caplog)
    assert "key_limits by " in limited and "requests_per_minute None → 60" in limited and "priority 'standard' → 'batch'" in limited
    run("key_limits", "alice", "--requests-per-minute", "60")  # no change: no line
    assert changes(caplog) == []

    run("create_api_key", "alice", "--replace")
    replaced = changes(caplog)
    assert any("deleted" in line for line in replaced) and any("created" in line for line in replaced)

    secret = tmp_path / "signing-key"
    secret.write_text("a-very-secret-signing-key\n")
    run("register_worker", "--pool", "p1", "--model", "m", "--role", "context", "--url", "http://10.0.0.1:8000",
        "--signing-key-file", str(secret), "--capacity", "4")  # fmt: skip
    registered = changes(caplog)
    assert any("pool 'p1'" in line and "created" in line and "handoff signing key set" in line for line in registered)
    assert any("context endpoint http://10.0.0.1:8000 added" in line for line in registered)
    assert any("capacity None → 4" in line for line in registered)
    assert not any("a-very-secret-signing-key" in line for line in registered)

    run("register_worker", "--pool", "p1", "--model", "m", "--role", "context", "--url", "http://10.0.0.1:8000")
    assert changes(caplog) == []  # already as asked: nothing changed, nothing logged

    run("model_route", "claude-sonnet-x", "--pool", "p1")
    [route] = changes(caplog)
    assert "model_route by " in route and "route created: claude-sonnet-x: p1" in route
    run("model_route", "claude-sonnet-x", "--display-name", "Sonnet")
    [changed] = changes(caplog)
    assert "route changed" in changed and '"Sonnet"' in changed
    run("model_route", "claude-sonnet-x", "--delete")
    [deleted] = changes(caplog)
    assert "route 'claude-sonnet-x' deleted" in deleted
