"""A plain OpenAI-compatible server: it knows no disaggregation (see `workers.protocols.openai`).

Disaggregation fields of any engine (`disaggregated_params`, `kv_transfer_params`, the
`bootstrap_*` trio) are ignored and the request is served whole, as the real servers do:
vLLM's request models accept unknown fields and log them as ignored, SGLang's are pydantic
models that drop them (pydantic's default `extra="ignore"`), llama.cpp and Ollama read only the
keys they know. A malformed body is still refused by the shared validation (vLLM: HTTP 400 with
the field named; tests/realengine/test_sim_matches_vllm.py holds the sim to it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..config import SimConfig
from ..schema import DisaggParams
from .base import ContextIssue, Dialect


class OpenAIDialect(Dialect):
    name: ClassVar[str] = "openai"
    # A plain server has no cache salt: `cache_salt` is an unknown field, ignored.
    cache_salt_field: ClassVar[str | None] = None

    def parse(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], config: SimConfig
    ) -> DisaggParams | None:
        return None

    def context_answer(self, issue: ContextIssue) -> bytes:
        # parse() never names a context phase, so the shared path never asks for one.
        raise AssertionError("a plain OpenAI-compatible server has no context phase")
