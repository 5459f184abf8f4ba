"""OpenTelemetry tracing end to end: real daphne gateways exporting OTLP/HTTP to a real receiver
(decoded with the official `opentelemetry-proto`), sim workers recording the `traceparent` they
were sent, and the audit row's trace id."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from tests.support.batches import BATCH_ENV, item
from tests.support.cluster import Cluster, audit_row, register_cluster, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.ports import refused_url
from tests.support.prometheus import metric_total
from tests.support.simworkers import SimWorker

SERVER, CLIENT, CONSUMER = 2, 3, 5  # opentelemetry.proto.trace.v1.Span.SpanKind
ERROR = 2  # Status.StatusCode


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def traced_env(receiver_url: str, **extra: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "gateway-under-test",
        **extra,
    }


@pytest.fixture
def traced(
    transactional_db: Any, gateways: Callable[..., Gateway], receiver: OtlpReceiver, context_worker: SimWorker, generation_worker: SimWorker
) -> tuple[Gateway, Cluster]:
    gateway = gateways(**traced_env(receiver.url))
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    return gateway, cluster


def post(gateway: Gateway, cluster: Cluster, text: str, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    payload = {"model": cluster.model, "max_tokens": 32, "messages": [{"role": "user", "content": text}], **body}
    return httpx.post(gateway.url + "/v1/messages", json=payload, headers=cluster.headers(**(headers or {})), timeout=30)


def worker_traceparent(worker: SimWorker, needle: str) -> str:
    entries = httpx.get(worker.url + "/sim/requests?headers=1", timeout=5, trust_env=False).json()
    [entry] = [e for e in entries if needle in str(e["body"].get("messages"))]
    traceparent: str = entry["headers"]["traceparent"]
    return traceparent


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    [span] = [s for s in spans if s.name == name]
    return span


def test_a_clients_trace_is_continued_into_the_workers(traced: tuple[Gateway, Cluster], receiver: OtlpReceiver) -> None:
    gateway, cluster = traced
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = post(gateway, cluster, "continued [sim tokens=4]", {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=x"})
    assert response.status_code == 200, response.text

    spans = receiver.wait_for(lambda spans: {"POST /v1/messages", "context", "generation"} <= {s.name for s in spans if s.trace_id == trace_id})
    spans = [s for s in spans if s.trace_id == trace_id]
    server, context, generation = one(spans, "POST /v1/messages"), one(spans, "context"), one(spans, "generation")
    assert server.kind == SERVER and server.parent_span_id == parent_id
    assert context.kind == CLIENT and context.parent_span_id == server.span_id
    assert generation.kind == CLIENT and generation.parent_span_id == server.span_id
    assert "gen_ai.first_token" in generation.events
    assert server.status_code != ERROR and generation.status_code != ERROR
    assert server.resource["service.name"] == "gateway-under-test"
    attributes = server.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == cluster.model == attributes["gen_ai.response.model"]
    assert attributes["gen_ai.request.max_tokens"] == 32
    assert attributes["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert attributes["gen_ai.usage.output_tokens"] == 4 and attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["http.response.status_code"] == 200 and attributes["http.route"] == "/v1/messages"
    assert attributes["gateway.pool"] == cluster.pool.name
    assert attributes["gateway.endpoint.generation"] == cluster.generation.url
    assert attributes["gateway.api_key.name"].startswith("test-key-") and attributes["gateway.priority"] == "standard"
    assert attributes["gateway.schedule"] == "context_first" and attributes["gen_ai.provider.name"] == "trtllm"
    # Nothing of the prompt, the answer, or the key itself (TRACE_RECORD_CONTENT is off).
    everything = repr([s.attributes for s in spans])
    assert "continued" not in everything and cluster.key not in everything
    assert not {"gen_ai.input.messages", "gen_ai.output.messages"} & set(attributes)

    # Each worker saw the gateway's client span for its call as the parent, in the client's trace.
    assert worker_traceparent(cluster.context, "continued") == f"00-{trace_id}-{context.span_id}-01"
    assert worker_traceparent(cluster.generation, "continued") == f"00-{trace_id}-{generation.span_id}-01"
    assert audit_row(response.headers["request-id"]).trace_id == trace_id


def test_a_new_trace_without_one(traced: tuple[Gateway, Cluster], receiver: OtlpReceiver) -> None:
    gateway, cluster = traced
    response = post(gateway, cluster, "fresh trace [sim tokens=2]", stream=True)
    assert response.status_code == 200, response.text
    row = audit_row(response.headers["request-id"])
    assert len(row.trace_id) == 32
    spans = receiver.wait_for(lambda spans: {"POST /v1/messages", "generation"} <= {s.name for s in spans if s.trace_id == row.trace_id})
    server = one(receiver.trace(row.trace_id), "POST /v1/messages")
    assert server.parent_span_id == "" and server.attributes["gateway.stream"] is True
    assert worker_traceparent(cluster.generation, "fresh trace").startswith(f"00-{row.trace_id}-")
    assert spans


def test_an_error_ends_the_spans_in_error(traced: tuple[Gateway, Cluster], receiver: OtlpReceiver) -> None:
    gateway, cluster = traced
    response = post(gateway, cluster, "fails [sim context_status=500]")
    assert response.status_code == 500
    row = audit_row(response.json()["request_id"])
    receiver.wait_for(lambda spans: {"POST /v1/messages", "context"} <= {s.name for s in spans if s.trace_id == row.trace_id})
    spans = receiver.trace(row.trace_id)
    server, context = one(spans, "POST /v1/messages"), one(spans, "context")
    assert server.status_code == ERROR and server.attributes["error.type"] == "api_error"
    assert server.attributes["http.response.status_code"] == 500
    assert context.status_code == ERROR and context.attributes["error.type"]


def test_sampling_off_traces_nothing_but_still_propagates(
    transactional_db: Any, gateways: Callable[..., Gateway], receiver: OtlpReceiver, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    gateway = gateways(**traced_env(receiver.url, OTEL_TRACES_SAMPLER="always_off"))
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    response = post(gateway, cluster, "unsampled [sim tokens=2]")
    assert response.status_code == 200, response.text
    assert audit_row(response.headers["request-id"]).trace_id == ""
    # Not sampled: the worker is told so (the sampled flag clear), and nothing reaches the receiver.
    traceparent = worker_traceparent(cluster.generation, "unsampled")
    assert int(traceparent.split("-")[3], 16) & 1 == 0
    assert receiver.trace(traceparent.split("-")[1]) == []


def test_an_exporter_that_is_down_costs_requests_nothing_and_drops_are_counted(
    transactional_db: Any, gateways: Callable[..., Gateway], context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    gateway = gateways(
        **traced_env(refused_url(), OTEL_BSP_MAX_QUEUE_SIZE="2", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1", OTEL_EXPORTER_OTLP_TIMEOUT="1")
    )
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    for n in range(8):
        response = post(gateway, cluster, f"nowhere {n} [sim tokens=2]")
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + 15
    while metric_total(httpx.get(gateway.url + "/metrics", timeout=5).text, "gateway_trace_spans_dropped_total") == 0:
        assert time.monotonic() < deadline, "no dropped spans counted"
        time.sleep(0.1)


def test_a_client_leaving_ends_the_spans_cancelled(traced: tuple[Gateway, Cluster], receiver: OtlpReceiver) -> None:
    gateway, cluster = traced
    trace_id = secrets.token_hex(16)
    headers = cluster.headers(traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01")
    body = {"model": cluster.model, "max_tokens": 32, "stream": True, "messages": [{"role": "user", "content": "leaving [sim context_delay=30]"}]}
    with httpx.Client(timeout=30) as client, client.stream("POST", gateway.url + "/v1/messages", json=body, headers=headers) as response:
        assert response.status_code == 200
        cluster.context.wait_for(lambda s: s["active"] == 1, timeout=10)
    # The connection closed: the request is cancelled, its worker call with it.
    receiver.wait_for(lambda spans: {"POST /v1/messages", "context"} <= {s.name for s in spans if s.trace_id == trace_id})
    spans = receiver.trace(trace_id)
    server, context = one(spans, "POST /v1/messages"), one(spans, "context")
    assert server.status_code == ERROR and server.attributes["error.type"] == "cancelled"
    assert context.status_code == ERROR and context.attributes["error.type"] == "cancelled"


def test_the_stages_are_children_of_the_request_span(traced: tuple[Gateway, Cluster], receiver: OtlpReceiver) -> None:
    gateway, cluster = traced
    response = post(gateway, cluster, "stages [sim tokens=3]", stream=True)
    assert response.status_code == 200, response.text
    trace_id = audit_row(response.headers["request-id"]).trace_id
    names = {"POST /v1/messages", "gateway.intake", "gateway.relay", "context", "generation"}
    receiver.wait_for(lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id})
    spans = receiver.trace(trace_id)
    server, intake, relay = one(spans, "POST /v1/messages"), one(spans, "gateway.intake"), one(spans, "gateway.relay")
    assert intake.parent_span_id == server.span_id and relay.parent_span_id == server.span_id
    assert intake.status_code != ERROR and relay.status_code != ERROR


def test_a_refused_body_ends_the_intake_span_with_anthropics_error_type(traced: tuple[Gateway, Cluster], receiver: OtlpReceiver) -> None:
    gateway, cluster = traced
    trace_id = secrets.token_hex(16)
    response = post(gateway, cluster, "refused", {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}, max_tokens=-1)
    assert response.status_code == 400, response.text
    receiver.wait_for(lambda spans: {"POST /v1/messages", "gateway.intake"} <= {s.name for s in spans if s.trace_id == trace_id})
    spans = receiver.trace(trace_id)
    server, intake = one(spans, "POST /v1/messages"), one(spans, "gateway.intake")
    assert intake.parent_span_id == server.span_id
    assert intake.status_code == ERROR and intake.attributes["error.type"] == "invalid_request_error"
    assert server.status_code == ERROR and server.attributes["error.type"] == "invalid_request_error"


def test_a_wait_for_a_slot_is_the_admission_span(
    transactional_db: Any, gateways: Callable[..., Gateway], receiver: OtlpReceiver, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    gateway = gateways(**traced_env(receiver.url))
    cluster = register_cluster(context_worker, generation_worker, generation_capacity=1)
    wait_registered(gateway, cluster)
    with ThreadPoolExecutor(1) as pool:
        # The first holds the pool's one generation slot through its context phase.
        holder = pool.submit(post, gateway, cluster, "holds [sim context_delay=1.5 tokens=2]")
        cluster.context.wait_for(lambda s: s["active"] == 1, timeout=10)
        response = post(gateway, cluster, "waits [sim tokens=2]")
        assert holder.result().status_code == 200
    assert response.status_code == 200, response.text
    row = audit_row(response.headers["request-id"])
    assert row.queued_ms is not None and row.queued_ms > 100
    receiver.wait_for(lambda spans: {"POST /v1/messages", "gateway.admission"} <= {s.name for s in spans if s.trace_id == row.trace_id})
    spans = receiver.trace(row.trace_id)
    server, admission = one(spans, "POST /v1/messages"), one(spans, "gateway.admission")
    assert admission.parent_span_id == server.span_id
    # What it waited in is its parent's to say (the child does not repeat it).
    assert server.attributes["gateway.pool"] == cluster.pool.name and server.attributes["gateway.priority"] == "standard"
    assert admission.end_ns - admission.start_ns >= 100e6


OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


def exemplar_trace_ids(text: str, name: str) -> set[str]:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    return {
        sample.exemplar.labels["trace_id"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.exemplar is not None
    }


def test_the_latency_histograms_carry_the_trace_as_an_exemplar_in_openmetrics(traced: tuple[Gateway, Cluster]) -> None:
    gateway, cluster = traced
    response = post(gateway, cluster, "exemplar [sim tokens=2]")
    assert response.status_code == 200, response.text
    trace_id = audit_row(response.headers["request-id"]).trace_id
    assert len(trace_id) == 32

    def scrape() -> httpx.Response:
        return httpx.get(gateway.url + "/metrics", headers={"accept": OPENMETRICS}, timeout=10)

    deadline = time.monotonic() + 15
    while trace_id not in exemplar_trace_ids(scrape().text, "gateway_request_duration_seconds_bucket"):
        assert time.monotonic() < deadline, "no exemplar with the request's trace id"
        time.sleep(0.1)
    scraped = scrape()
    assert scraped.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert trace_id in exemplar_trace_ids(scraped.text, "gateway_time_to_first_token_seconds_bucket")
    # The plain text format, without exemplars, for a scraper that does not ask for OpenMetrics.
    plain = httpx.get(gateway.url + "/metrics", timeout=10)
    assert plain.headers["content-type"].startswith("text/plain") and trace_id not in plain.text
    assert metric_total(plain.text, "gateway_request_duration_seconds_count") >= 1


@pytest.fixture
def batch_gateway(transactional_db: Any, receiver: OtlpReceiver) -> Iterator[Gateway]:
    """A traced gateway with a batch runner, stopped after the test (its runner would claim the
    next test's items)."""
    gateway = Gateway({**BATCH_ENV, **traced_env(receiver.url)}).start()
    try:
        yield gateway
    finally:
        gateway.stop()


def test_batch_items_are_traces_of_their_own_linked_to_the_batch(
    batch_gateway: Gateway, receiver: OtlpReceiver, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    from messages_api.models import MessageRequest

    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(batch_gateway, cluster)
    trace_id = secrets.token_hex(16)
    body = {"requests": [item("first", "item one [sim tokens=2]", cluster.model), item("second", "item two [sim tokens=2]", cluster.model)]}
    headers = cluster.headers(traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01")
    created = httpx.post(batch_gateway.url + "/v1/messages/batches", json=body, headers=headers, timeout=30)
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    def items(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.name == "batch item" and s.attributes.get("gateway.batch_id") == batch_id]

    spans = receiver.wait_for(lambda spans: len(items(spans)) == 2 and any(s.name == "POST /v1/messages/batches" for s in spans), timeout=30)
    creation = one([s for s in spans if s.trace_id == trace_id], "POST /v1/messages/batches")
    first, second = sorted(items(spans), key=lambda s: s.attributes["gateway.batch.custom_id"])
    assert first.trace_id != second.trace_id and trace_id not in (first.trace_id, second.trace_id)
    for span in (first, second):
        assert span.parent_span_id == "" and span.kind == CONSUMER and span.status_code != ERROR
        assert span.links == [(trace_id, creation.span_id)]
        assert span.attributes["gateway.batch.attempt"] == 1
    # Each item's own work (its worker calls) in its own trace, and its audit row naming it.
    receiver.wait_for(lambda spans: {"generation"} <= {s.name for s in spans if s.trace_id == first.trace_id})
    assert one(receiver.trace(first.trace_id), "generation").parent_span_id == first.span_id
    wait_until(lambda: MessageRequest.objects.filter(batch_id=batch_id, status="completed").count() == 2, message="the items never completed")
    rows = {row.custom_id: row.trace_id for row in MessageRequest.objects.filter(batch_id=batch_id)}
    assert rows == {"first": first.trace_id, "second": second.trace_id}


def test_content_recording_puts_the_prompt_and_answer_on_the_span_bounded(
    transactional_db: Any, gateways: Callable[..., Gateway], receiver: OtlpReceiver, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    gateway = gateways(**traced_env(receiver.url, TRACE_RECORD_CONTENT="1", TRACE_RECORD_CONTENT_MAX_CHARS="200"))
    cluster = register_cluster(context_worker, generation_worker)
    wait_registered(gateway, cluster)
    history = [{"role": "user", "content": "an old turn " + "o" * 300}, {"role": "assistant", "content": "an old answer"}]
    response = post(
        gateway, cluster, "recorded [sim tokens=6]", stream=True, system="be brief",
        messages=[*history, {"role": "user", "content": "recorded [sim tokens=6]"}],
    )
    assert response.status_code == 200, response.text
    answer = "".join(
        orjson.loads(line[5:])["delta"].get("text", "")
        for line in response.text.splitlines() if line.startswith("data:") and "text_delta" in line
    )  # fmt: skip
    trace_id = audit_row(response.headers["request-id"]).trace_id
    receiver.wait_for(lambda spans: any(s.name == "POST /v1/messages" for s in spans if s.trace_id == trace_id))
    attributes = one(receiver.trace(trace_id), "POST /v1/messages").attributes
    prompt = orjson.loads(attributes["gen_ai.input.messages"])
    # The latest turns first, within 200 characters: the old turn's text cut short.
    assert prompt[-1] == {"role": "user", "parts": [{"type": "text", "content": "recorded [sim tokens=6]"}]}
    assert prompt[-2] == {"role": "assistant", "parts": [{"type": "text", "content": "an old answer"}]}
    assert len(prompt[0]["parts"][0]["content"]) == 200 - len("recorded [sim tokens=6]") - len("an old answer")
    assert orjson.loads(attributes["gen_ai.system_instructions"]) == [{"type": "text", "content": "be brief"}]
    [output] = orjson.loads(attributes["gen_ai.output.messages"])
    assert output == {"role": "assistant", "parts": [{"type": "text", "content": answer}], "finish_reason": "end_turn"} and answer


def test_a_client_leaving_before_the_first_token_ends_the_generation_call_cancelled(
    traced: tuple[Gateway, Cluster], receiver: OtlpReceiver
) -> None:
    gateway, cluster = traced
    trace_id = secrets.token_hex(16)
    headers = cluster.headers(traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01")
    # The context phase is done and the generation request sent; its first token waits 30 s.
    body = {"model": cluster.model, "max_tokens": 32, "stream": True, "messages": [{"role": "user", "content": "first token [sim gen_delay=30]"}]}
    with httpx.Client(timeout=30) as client, client.stream("POST", gateway.url + "/v1/messages", json=body, headers=headers) as response:
        assert response.status_code == 200
        cluster.generation.wait_for(lambda s: s["active"] == 1, timeout=10)
    # The run's cleanup closes the generation request (after its worker took the handoff): its
    # span ends there, cancelled, not left open and lost.
    receiver.wait_for(lambda spans: {"POST /v1/messages", "generation"} <= {s.name for s in spans if s.trace_id == trace_id}, timeout=30)
    spans = receiver.trace(trace_id)
    for name in ("POST /v1/messages", "generation"):
        span = one(spans, name)
        assert span.status_code == ERROR and span.attributes["error.type"] == "cancelled", name


def test_a_client_leaving_mid_stream_ends_the_relay_cancelled(
    transactional_db: Any, gateways: Callable[..., Gateway], receiver: OtlpReceiver, sim_pair: Callable[..., tuple[SimWorker, SimWorker]]
) -> None:
    gateway = gateways(**traced_env(receiver.url))
    context, generation = sim_pair("trtllm", tokens_per_second=20)  # 100 tokens: 5 s of stream
    cluster = register_cluster(context, generation)
    wait_registered(gateway, cluster)
    trace_id = secrets.token_hex(16)
    headers = cluster.headers(traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01")
    body = {"model": cluster.model, "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "mid-stream [sim tokens=100]"}]}
    with httpx.Client(timeout=30) as client, client.stream("POST", gateway.url + "/v1/messages", json=body, headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "event: content_block_delta":
                break  # a token relayed: leave
    receiver.wait_for(lambda spans: {"POST /v1/messages", "gateway.relay", "generation"} <= {s.name for s in spans if s.trace_id == trace_id})
    spans = receiver.trace(trace_id)
    for name in ("POST /v1/messages", "gateway.relay", "generation"):
        span = one(spans, name)
        assert span.status_code == ERROR and span.attributes["error.type"] == "cancelled", name


def test_a_worker_failing_mid_stream_ends_the_relay_and_the_request_in_error(traced: tuple[Gateway, Cluster], receiver: OtlpReceiver) -> None:
    gateway, cluster = traced
    response = post(gateway, cluster, "breaks [sim tokens=10 gen_fail_after=2]", stream=True)
    assert response.status_code == 200 and "event: error" in response.text
    trace_id = audit_row(response.headers["request-id"]).trace_id
    receiver.wait_for(lambda spans: {"POST /v1/messages", "gateway.relay"} <= {s.name for s in spans if s.trace_id == trace_id})
    spans = receiver.trace(trace_id)
    server, relay, generation = one(spans, "POST /v1/messages"), one(spans, "gateway.relay"), one(spans, "generation")
    assert server.status_code == ERROR and server.attributes["error.type"] == "api_error"
    assert relay.status_code == ERROR and relay.attributes["error.type"] not in ("", "cancelled")
    assert generation.status_code == ERROR and relay.parent_span_id == server.span_id
