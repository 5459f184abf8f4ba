"""One trace from the client through the gateway into a real vLLM server: vLLM is started with
`--otlp-traces-endpoint` (tests/support/realvllm/server.py, `tracing_options`) and the gateway with
the OTEL_* variables, both exporting to one OTLP/HTTP receiver built on the official
`opentelemetry-proto`. vLLM reads the `traceparent` the gateway sends with its generation call and
parents its `llm_request` span on that call's client span.

Skips without the real engine (`make vllm`); with REQUIRE_REAL_VLLM=1 (CI) it runs.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.support.cluster import audit_row, wait_registered
from tests.support.gateway import Gateway
from tests.support.otlp_receiver import ReceivedSpan
from tests.support.realvllm.server import RealVllm, trace_receiver

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


@pytest.fixture
def traced_gateway(gateways: Callable[..., Gateway], engine: RealVllm) -> Gateway:
    return gateways(
        OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=trace_receiver().url,
        OTEL_BSP_SCHEDULE_DELAY="50", OTEL_SERVICE_NAME="gateway-under-test",
    )  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_vllms_span_is_a_child_of_the_gateways_generation_call(
    transactional_db: Any, traced_gateway: Gateway, engine: RealVllm, stream: bool
) -> None:
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(name=f"traced-{engine.model}", model=engine.model, schedule_style="aggregated", protocol="vllm")
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=engine.url)
    _, key = create_api_key(f"traced-vllm-{time.monotonic_ns()}")

    wait_registered(traced_gateway, SimpleNamespace(pool=pool))  # type: ignore[arg-type]  # reads only .pool

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(
        traced_gateway.url + "/v1/messages",
        json={"model": engine.model, "max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": "hello"}]},
        headers={"x-api-key": key, "anthropic-version": "2023-06-01", "traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert audit_row(response.headers["request-id"]).trace_id == trace_id

    receiver = trace_receiver()

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"POST /v1/messages", "generation", "llm_request"} <= names

    receiver.wait_for(complete, timeout=60)
    spans = receiver.trace(trace_id)
    [server] = [s for s in spans if s.name == "POST /v1/messages"]
    [generation] = [s for s in spans if s.name == "generation"]
    [engine_span] = [s for s in spans if s.name == "llm_request"]
    assert server.parent_span_id == client_span and server.resource["service.name"] == "gateway-under-test"
    assert generation.kind == CLIENT and generation.parent_span_id == server.span_id
    # vLLM's own span, exported by vLLM, under the gateway's generation call in the client's trace.
    assert engine_span.kind == SERVER and engine_span.parent_span_id == generation.span_id
    assert engine_span.resource["service.name"] == "vllm"
    assert engine_span.attributes["gen_ai.usage.completion_tokens"] == server.attributes["gen_ai.usage.output_tokens"]
