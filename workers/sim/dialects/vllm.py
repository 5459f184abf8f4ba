"""vLLM's `kv_transfer_params`, as its NixlConnector reads and writes them (see
`workers.protocols.vllm` for the gateway's side).

- Prefill: a request with `kv_transfer_params.do_remote_decode` on a context sim is prefilled,
  its handoff held, and answered the way a real vLLM 0.32 server with NixlConnector answered one:
  one token, `finish_reason: "length"`, and a top-level `kv_transfer_params` naming the engine,
  host, port, request and blocks to pull from (with the same keys as that server's).
- Decode: a request with `do_remote_prefill` on a generation sim pulls the KV from
  `remote_host:remote_port`, which here is the context sim's own HTTP address (a real engine
  names its NIXL side channel there), and streams. NixlConnector computes the prompt itself,
  with only a warning, when `remote_block_ids` is empty or one of `remote_engine_id`,
  `remote_host`, `remote_port`, `remote_request_id` is missing; so does the sim. Params that are
  all there but name no KV (another engine, an unknown or already taken request) make a real
  vLLM fail the request with a bare 500 "Internal server error"; so does the sim.
- Anything else, `disaggregated_params` included, is an unknown field, which vLLM's request
  models accept and ignore (`extra="allow"`, with a logged warning): a plain request.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

import orjson

from ..config import SimConfig
from ..engine_metrics import MetricNames
from ..error_answers import SimError
from ..schema import DisaggParams
from ..wire import prefill_completion, usage
from .base import ContextIssue, Dialect

# The CPU backend's KV block size (what the blocks a sim prefill reports are counted in).
BLOCK_TOKENS = 128
# The fields NixlConnector needs before it pulls anything (else it prefills locally).
PULL_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")
_REMOTE_REQUEST_ID = re.compile(r"chatcmpl-sim-([0-9a-f]{16})")


class VllmInternalError(SimError):
    """vLLM's answer to a request its engine failed: no detail, `code` an integer."""

    def __init__(self) -> None:
        super().__init__(500, "Internal server error", type="InternalServerError")

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "param": None, "code": self.status}}
        )


def engine_id(url: str) -> str:
    """A context sim's engine id: fixed by its address, so a decode sim can check the one it
    is given without asking."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


def remote_request_id(handoff_id: int) -> str:
    return f"chatcmpl-sim-{handoff_id:016x}"


def _http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bad_params(value: Any) -> SimError:
    # vLLM's pydantic validation error for a kv_transfer_params that is not an object.
    return SimError(
        400,
        "1 validation error:\n  {'type': 'dict_type', 'loc': 'body.kv_transfer_params', "
        f"'msg': 'Input should be a valid dictionary', 'input': {value!r}}}",
        type="Bad Request",
        param="body.kv_transfer_params",
    )


class VllmDialect(Dialect):
    name: ClassVar[str] = "vllm"
    # vllm/v1/metrics/loggers.py: one series per engine, labelled with it.
    metrics: ClassVar[MetricNames | None] = MetricNames(
        "/metrics", "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", (("engine", "0"),)
    )

    def parse(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], config: SimConfig
    ) -> DisaggParams | None:
        params = payload.get("kv_transfer_params")
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise _bad_params(params)
        if params.get("do_remote_prefill"):
            return self._decode(params)
        if params.get("do_remote_decode"):
            # vLLM's request carries no id for the handoff: the engine names it (remote_request_id).
            return DisaggParams(
                request_type="context_only",
                disagg_request_id=random.getrandbits(62),
                ctx_request_id=None,
                encoded_opaque_state=None,
                kv_source_url=None,
                schedule_style=None,
            )
        return None

    def _decode(self, params: Mapping[str, Any]) -> DisaggParams | None:
        if not params.get("remote_block_ids") or not all(name in params for name in PULL_FIELDS):
            return None  # NixlConnector: "This request will not utilize KVTransfer"
        host, port = params["remote_host"], params["remote_port"]
        if not isinstance(host, str) or not host or not isinstance(port, int) or isinstance(port, bool):
            raise VllmInternalError()
        if not 0 < port < 65536:
            raise VllmInternalError()
        source = _http_url(host, port)
        match = _REMOTE_REQUEST_ID.fullmatch(str(params["remote_request_id"]))
        if match is None or params["remote_engine_id"] != engine_id(source):
            raise VllmInternalError()
        return DisaggParams(
            request_type="generation_only",
            disagg_request_id=None,
            ctx_request_id=int(match.group(1), 16),
            encoded_opaque_state=None,
            kv_source_url=source,
            schedule_style=None,
        )

    def transfer_failed(self, error: SimError) -> SimError:
        return VllmInternalError()

    def context_answer(self, issue: ContextIssue) -> bytes:
        prompt_tokens = len(issue.prompt_token_ids)
        address = urlsplit(issue.public_url)
        blocks = list(range(1, max(1, math.ceil(prompt_tokens / BLOCK_TOKENS)) + 1))
        return prefill_completion(
            issue.config.model,
            choice={"logprobs": None, "finish_reason": "length", "stop_reason": None},
            body={
                "usage": usage(prompt_tokens, 1),
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [blocks],
                    "remote_engine_id": engine_id(issue.public_url),
                    "remote_request_id": remote_request_id(issue.handoff_id),
                    "remote_host": address.hostname,
                    "remote_port": address.port,
                    "tp_size": 1,
                    "dcp_size": 1,
                    "pp_size": 1,
                    "remote_num_tokens": prompt_tokens,
                    "remote_blocks_expiry_time": None,
                    "transfer_mode": "pull",
                    "remote_prefill_cached_tokens": 0,
                },
            },
        )
