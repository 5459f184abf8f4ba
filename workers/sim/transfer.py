"""The generation worker's side of the KV transfer: pulling a handoff from a context worker.

The pull happens before any response bytes are sent, so every way it can fail becomes an
ordinary error status for the generation request:

    not issued / bad state / unreachable (context-first)   400
    context phase failed or aborted (generation-first)      500
    context phase did not finish in time                    504
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from .errors import SimError
from .schema import DisaggParams

TAKE_PATH = "/sim/kv/take"
# The take route's answer status for each outcome; the puller reads the JSON `status` first.
TAKE_STATUS_CODES: dict[str, int] = {"taken": 200, "not_issued": 404, "failed": 409, "timeout": 504}


def _not_issued(handoff_id: int, detail: str) -> SimError:
    return SimError(
        400,
        f"disaggregated handoff {handoff_id} was not issued by a context worker ({detail})",
        param="disaggregated_params",
        code="invalid_handoff",
    )


def _context_failed(handoff_id: int, detail: str) -> SimError:
    return SimError(500, f"context phase for request {handoff_id} failed: {detail}")


def _context_timeout(handoff_id: int, detail: str) -> SimError:
    return SimError(504, f"context phase for request {handoff_id} timed out: {detail}")


class KvPuller:
    """Takes handoffs from context workers over one shared, pooled HTTP client: stock httpx on its
    default transport, not the gateway's worker transport, so the test double shares no code with
    what it tests. Kept open and reused (a client per pull would pay its set-up each time)."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                # Generation-first pulls wait for their context phase: one connection each.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=4.0),
                trust_env=False,  # never route worker-to-worker calls through a proxy
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def pull(self, disagg: DisaggParams, wait_s: float) -> dict[str, Any]:
        """Takes the handoff `disagg` names; raises SimError if it cannot be had.

        Cancelling this (the generation client left) closes the take call, which the context
        worker sees as a disconnect and stops waiting.
        """
        handoff_id = disagg.handoff_id
        if handoff_id is None:
            raise SimError(
                400, "generation_only request carries no ctx_request_id",
                param="disaggregated_params",
            )
        state = disagg.encoded_opaque_state
        generation_first = state is None
        endpoint = disagg.ctx_info_endpoint
        if not endpoint or not endpoint.startswith(("http://", "https://")):
            raise _not_issued(handoff_id, "no usable ctx_info_endpoint")
        payload = {
            "ctx_request_id": handoff_id,
            "encoded_opaque_state": state,
            "wait_s": wait_s if generation_first else 0.0,
        }
        try:
            response = await self._http().post(
                endpoint.rstrip("/") + TAKE_PATH,
                content=orjson.dumps(payload),
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(wait_s + 10.0, connect=5.0),
            )
        except httpx.HTTPError:
            detail = "the context worker named by ctx_info_endpoint is unreachable"
            if generation_first:
                raise _context_failed(handoff_id, detail) from None
            raise _not_issued(handoff_id, detail) from None
        return self._interpret(handoff_id, generation_first, response)

    @staticmethod
    def _interpret(
        handoff_id: int, generation_first: bool, response: httpx.Response
    ) -> dict[str, Any]:
        try:
            body = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        status = body.get("status")
        detail = str(body.get("message") or f"take answered HTTP {response.status_code}")
        if response.status_code == 200 and status == "taken":
            return body
        if status == "failed":
            raise _context_failed(handoff_id, detail)
        if status == "timeout":
            raise _context_timeout(handoff_id, detail)
        if status == "not_issued" or not generation_first:
            raise _not_issued(handoff_id, detail)
        raise _context_failed(handoff_id, detail)
