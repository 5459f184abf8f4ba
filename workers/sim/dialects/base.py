"""What every simulated engine dialect provides (see `workers.sim.dialects`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..config import SimConfig
from ..engine_metrics import MetricNames
from ..error_answers import SimError
from ..schema import DisaggParams


@dataclass(frozen=True, slots=True)
class ContextIssue:
    """A context worker's finished prefill, to be written as its engine's answer."""

    config: SimConfig
    #: The context worker's own base URL (what a generation sim pulls the KV from).
    public_url: str
    handoff_id: int
    #: The signed state a context-first generation request must present to take the handoff.
    encoded_opaque_state: str
    first_gen_tokens: list[int]
    prompt_token_ids: list[int]
    #: The request asked for the ids as base64 int32 (`DisaggParams.prompt_ids_b64`).
    prompt_ids_b64: bool = False


class Dialect:
    """One engine's disaggregation wire format. Stateless; one instance serves every request."""

    name: ClassVar[str]
    #: The request field the engine salts its prefix cache with (None: it has none).
    cache_salt_field: ClassVar[str | None] = "cache_salt"
    #: Where and how the engine publishes its load (`workers.sim.engine_metrics`); None: it has
    #: no metrics route (a plain OpenAI server).
    metrics: ClassVar[MetricNames | None] = None

    def parse(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], config: SimConfig
    ) -> DisaggParams | None:
        """The request's disaggregation, or None for a plain (aggregated) request.

        `headers` are the request's headers, lower-cased. Raises `SimError` for what the real
        engine would refuse.
        """
        raise NotImplementedError

    def context_id_of(self, payload: Any) -> int | None:
        """The handoff id of a context request, read leniently from a body that failed
        validation (so a generation-first taker waiting on it fails at once)."""
        return None

    def transfer_failed(self, error: SimError) -> SimError:
        """The answer to a generation request whose KV pull failed with `error` (engines word
        that differently)."""
        return error

    def context_answer(self, issue: ContextIssue) -> bytes:
        """The context worker's answer to a context request (its body, JSON)."""
        raise NotImplementedError

    def server_info(self, config: SimConfig, public_url: str) -> dict[str, Any] | None:
        """The body of `GET /server_info`, or None where the engine has no such route."""
        return None
