"""SGLang's bootstrap room (see `workers.protocols.sglang` for the gateway's side).

Every simulated SGLang worker runs disaggregated: a context sim is a prefill-mode server, a
generation sim a decode-mode one. Both receive the same chat request carrying `bootstrap_host`,
`bootstrap_port` and `bootstrap_room`:

- prefill: prefills, files the KV handoff under the room, and answers an ordinary chat
  completion (one token; the router drops it);
- decode: waits for the room's prefill at `bootstrap_host:bootstrap_port`, then generates. A
  sim's bootstrap port is its HTTP port (it reports it in `/server_info` as SGLang reports
  `disaggregation_bootstrap_port`), so the decode sim pulls the KV from
  `http://bootstrap_host:bootstrap_port`.

Refused with HTTP 400, as SGLang refuses them: a request with no room on a disaggregated server
(its scheduler's "Disaggregated request received without boostrap room id", spelling and all),
a room that is not an integer in 0..2^63-1 (the request model's `int` field; the router's room
range), a decode request with no `bootstrap_host`. A decode request whose `bootstrap_port` is
null is refused too: the sim has no default bootstrap port to fall back to, and it names the
omission instead of failing a transfer. Batched (list) bootstrap fields belong to `n > 1`, which
the sim does not serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..config import SimConfig
from ..engine_metrics import MetricNames
from ..error_answers import SimError
from ..schema import DisaggParams
from ..wire import prefill_completion, usage
from .base import ContextIssue, Dialect

MAX_ROOM = 2**63 - 1
NO_ROOM = "Disaggregated request received without boostrap room id"


def _bad(message: str, param: str) -> SimError:
    return SimError(400, message, param=param)


def _room(value: Any) -> int:
    if isinstance(value, list):
        raise _bad("batched bootstrap fields (n > 1) are not simulated", "bootstrap_room")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad("bootstrap_room must be an integer", "bootstrap_room")
    if not 0 <= value <= MAX_ROOM:
        raise _bad("bootstrap_room must be in 0..2^63-1", "bootstrap_room")
    return value


def _port(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise _bad("bootstrap_port must be a TCP port number", "bootstrap_port")
    return value


def _host(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad("bootstrap_host must be a non-empty string", "bootstrap_host")
    return value


def bootstrap_url(host: str, port: int) -> str:
    """The HTTP base of the sim whose bootstrap port (its HTTP port) is `host:port`."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class SglangDialect(Dialect):
    name: ClassVar[str] = "sglang"
    # python/sglang/srt/metrics/collector.py (served with --enable-metrics).
    metrics: ClassVar[MetricNames | None] = MetricNames(
        "/metrics", "sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"
    )

    def parse(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], config: SimConfig
    ) -> DisaggParams | None:
        if payload.get("bootstrap_room") is None:
            raise _bad(NO_ROOM, "bootstrap_room")
        room = _room(payload["bootstrap_room"])
        host = _host(payload.get("bootstrap_host"))
        port = _port(payload.get("bootstrap_port"))
        if config.role == "context":
            return DisaggParams(
                request_type="context_only",
                disagg_request_id=room,
                ctx_request_id=room,
                encoded_opaque_state=None,
                kv_source_url=None,
                schedule_style=None,
            )
        if host is None:
            raise _bad("a decode request needs bootstrap_host (the prefill server)", "bootstrap_host")
        if port is None:
            raise _bad("a decode request needs bootstrap_port (the prefill server's)", "bootstrap_port")
        return DisaggParams(
            request_type="generation_only",
            disagg_request_id=room,
            ctx_request_id=room,
            encoded_opaque_state=None,
            kv_source_url=bootstrap_url(host, port),
            schedule_style=None,
            rendezvous=True,
        )

    def context_id_of(self, payload: Any) -> int | None:
        if not isinstance(payload, Mapping):
            return None
        room = payload.get("bootstrap_room")
        return room if isinstance(room, int) and not isinstance(room, bool) else None

    def context_answer(self, issue: ContextIssue) -> bytes:
        return prefill_completion(
            issue.config.model,
            choice={"finish_reason": "length", "matched_stop": None},
            body={"usage": usage(len(issue.prompt_token_ids), 1)},
        )

    def server_info(self, config: SimConfig, public_url: str) -> dict[str, Any] | None:
        # What SGLang's /server_info reports that a router reads. No model_path or tokenizer_path:
        # sglang-router downloads a tokenizer for any model path a worker reports.
        return {
            "disaggregation_mode": "prefill" if config.role == "context" else "decode",
            "disaggregation_bootstrap_port": config.port,
            "served_model_name": config.model,
            "context_length": config.max_context_tokens,
        }
