"""The settings one simulated worker runs with, fixed for the life of its process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["context", "generation"]
ROLES: tuple[Role, ...] = ("context", "generation")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What `manage.py simworker` was started with."""

    role: Role
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    max_context_tokens: int = 131072
    # 0 means "no pacing": tokens go out as fast as the event loop allows (benchmarks).
    tokens_per_second: float = 200.0
    # 0 means prefill is instant.
    prefill_tokens_per_second: float = 50000.0
    # How long a context worker holds an untaken handoff, and how long a generation-first
    # take waits for its context phase.
    kv_timeout: float = 60.0
    # The engine dialect of disaggregated requests (`workers.sim.dialects`).
    protocol: str = "trtllm"
    # The shared secret signed handoffs are checked with (TensorRT-LLM's
    # `internal_request_auth_key`); "" checks none. Never shown: it is a secret.
    internal_request_auth_key: str = field(default="", repr=False)

    @property
    def token_interval(self) -> float:
        """Seconds between two streamed tokens; 0.0 when unpaced."""
        return 1.0 / self.tokens_per_second if self.tokens_per_second > 0 else 0.0

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """How long prefilling a prompt of that many tokens takes."""
        if self.prefill_tokens_per_second <= 0:
            return 0.0
        return prompt_tokens / self.prefill_tokens_per_second
