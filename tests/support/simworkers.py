"""Simulated workers as real processes, for tests: `workers.sim.process` under the test settings.

    worker = start_simworker("context", kv_timeout=5)
    ...  # drive the gateway, which calls worker.url
    worker.wait_for(lambda s: s["completed"] == 1)
"""

from __future__ import annotations

from typing import Any

from workers.sim.process import SimWorker
from workers.sim.process import start_simworker as _start

__all__ = ["SimWorker", "start_simworker"]


def start_simworker(role: str, *, host: str = "127.0.0.1", env: dict[str, str] | None = None, **options: Any) -> SimWorker:
    return _start(role, host=host, env={"DJANGO_SETTINGS_MODULE": "disagg_project.test_settings", **(env or {})}, **options)
