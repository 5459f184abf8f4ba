"""A retired setting still present in the environment is reported by `manage.py check`, not
silently ignored."""

from __future__ import annotations

import pytest

from workers.checks import check_retired_settings


def test_a_retired_setting_in_the_environment_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_MAX_CONNECTIONS", "64")
    [warning] = check_retired_settings()
    assert warning.id == "workers.W001" and "REDIS_MAX_CONNECTIONS" in warning.msg and "REDIS_MAX_IN_FLIGHT" in (warning.hint or "")


def test_nothing_is_said_when_none_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_MAX_CONNECTIONS", raising=False)
    assert check_retired_settings() == []
