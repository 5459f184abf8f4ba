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
    # The prefix cache (`workers.sim.prefix_cache`): tokens per KV block, and how many blocks
    # it holds (0: no cache, every prompt is prefilled whole and reports 0 cached tokens).
    kv_block_tokens: int = 16
    kv_cache_blocks: int = 0
    # The prefill rate of a generation worker's own (aggregated, no context phase) requests;
    # None: the same as prefill_tokens_per_second.
    local_prefill_tokens_per_second: float | None = None
    # How many prefills run at once (an accelerator computes one batch at a time; queued prompts
    # wait their turn); 0: unlimited, each prompt's prefill time is independent.
    prefill_concurrency: int = 0
    # Requests the engine reports in its metrics beyond its own (`workers.sim.engine_metrics`):
    # traffic that never passed through the gateway. `POST /sim/outside_load` changes them.
    outside_waiting: int = 0
    outside_running: int = 0
    # KV-cache events on vLLM's wire (`workers.sim.kv_publisher`): the PUB and replay addresses to
    # bind ("" : none), the hash algorithm and seed of the block hashes (vLLM's), the ring's size.
    kv_events_address: str = ""
    kv_replay_address: str = ""
    kv_hash_algorithm: str = "sha256"
    kv_hash_seed: str | None = None
    kv_buffer_steps: int = 10000

    @property
    def token_interval(self) -> float:
        """Seconds between two streamed tokens; 0.0 when unpaced."""
        return 1.0 / self.tokens_per_second if self.tokens_per_second > 0 else 0.0

    def prefill_seconds(self, prompt_tokens: int, *, local: bool = False) -> float:
        """How long prefilling a prompt of that many (uncached) tokens takes; `local`: a
        generation worker prefilling a request without a context phase."""
        rate = self.prefill_tokens_per_second
        if local and self.local_prefill_tokens_per_second is not None:
            rate = self.local_prefill_tokens_per_second
        if rate <= 0:
            return 0.0
        return prompt_tokens / rate
