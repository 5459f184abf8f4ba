"""Simulated workers as real processes, for tests: `workers.sim.process` under the test settings.

    worker = start_simworker("context", kv_timeout=5)
    ...  # drive the gateway, which calls worker.url
    worker.wait_for(lambda s: s["completed"] == 1)
"""

from __future__ import annotations

import json
from typing import Any

from workers.sim.process import SimWorker
from workers.sim.process import start_simworker as _start

__all__ = ["SimWorker", "requests_with", "sim_output", "start_simworker"]


def start_simworker(role: str, *, host: str = "127.0.0.1", env: dict[str, str] | None = None, **options: Any) -> SimWorker:
    return _start(role, host=host, env={"DJANGO_SETTINGS_MODULE": "disagg_project.test_settings", **(env or {})}, **options)


def sim_output(generation_request: dict[str, Any]) -> str:
    """The text the sim generated for a request its generation worker logged (it is deterministic)."""
    from workers.sim.output import plan_generation
    from workers.sim.schema import parse_chat_request
    from workers.sim.tokenizer import tokenize_chat

    request = parse_chat_request(generation_request)
    prompt = request.prompt_token_ids if request.prompt_token_ids is not None else tokenize_chat(request.messages, request.tools)
    limit = request.max_tokens if request.max_tokens is not None else 1 << 30
    return plan_generation(prompt, request.directives, tools=request.tools, limit=limit, stop=request.stop).content


def requests_with(worker: SimWorker, needle: str) -> list[dict[str, Any]]:
    """The worker's logged requests with `needle` in some message, oldest first."""
    return [r for r in worker.requests() if needle in json.dumps(r.get("messages"), ensure_ascii=False)]
