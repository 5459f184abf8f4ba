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

from .error_answers import SimError
from .schema import DisaggParams

TAKE_PATH = "/sim/kv/take"
# httpcore's pool looks at every one of its connections, with a system call each, on every request
# and release: one pool for all pulls costs more the more pulls run at once (measured with 32
# concurrent requests: the generation sim's CPU per request went from ~2.6 ms to ~1.2 ms when the
# pulls were spread over 16 pools). So pulls are spread over a few pools, each holding few connections.
PULL_POOLS = 16
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
    """Takes handoffs from context workers over a few shared connection pools: stock httpx on its
    default transport (httpcore), not the gateway's worker transport, so the test double shares no
    code with what it tests. The pools are kept open and reused, and called directly: the
    `AsyncClient` layers (cookies, auth, redirects, URL merging) do nothing for a pull and cost
    a fifth of its CPU."""

    def __init__(self) -> None:
        self._pools: dict[int, httpx.AsyncHTTPTransport] = {}

    def _pool(self, handoff_id: int) -> httpx.AsyncHTTPTransport:
        shard = handoff_id % PULL_POOLS  # handoff ids are random: the pulls spread evenly
        pool = self._pools.get(shard)
        if pool is None:
            # Generation-first pulls wait for their context phase: one connection each. Used
            # without a client, the transport takes no proxy from the environment.
            pool = self._pools[shard] = httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=4.0),
            )
        return pool

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            await pool.aclose()

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
        generation_first = disagg.rendezvous
        endpoint = disagg.kv_source_url
        if not endpoint or not endpoint.startswith(("http://", "https://")):
            raise _not_issued(handoff_id, "no usable ctx_info_endpoint")
        payload = {
            "ctx_request_id": handoff_id,
            "encoded_opaque_state": state,
            "wait_s": wait_s if generation_first else 0.0,
        }
        request = httpx.Request(
            "POST",
            endpoint.rstrip("/") + TAKE_PATH,
            content=orjson.dumps(payload),
            headers={"content-type": "application/json"},
            extensions={"timeout": httpx.Timeout(wait_s + 10.0, connect=5.0).as_dict()},
        )
        try:
            response = await self._pool(handoff_id).handle_async_request(request)
            try:
                await response.aread()
            finally:
                await response.aclose()
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
