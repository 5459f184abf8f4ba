#!/usr/bin/env python
"""What tracing costs per request, span by span, in process: the CPU of the spans a traced request
makes (its thread) and of their OTLP encoding (the export thread's), with every span sampled.

    .venv/bin/python bench/trace_span_cost.py            # best of 15 rounds x 300 requests
    .venv/bin/python bench/trace_span_cost.py --quick    # 3 rounds x 100

The request's spans as the gateway makes them (disagg_project/telemetry.py's facade): the server
span with a real request's attributes; the intake span; two worker calls (client spans, their
traceparent injected into a header dict, the first token an event); the relay span; and the two
histogram observations with the trace id as exemplar (messages_api/metrics.py). Each part is timed
alone (`time.thread_time`, this thread only: other processes' load does not count), and the
ended spans are encoded with the OTLP exporter's own encoder (`encode_spans`, what the export
thread runs before its HTTP post) and timed per span. Prints µs per request per part, best round.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: F401  (puts the project on the import path)


class Keep:
    """A span exporter that keeps what it is given (encoded separately, timed)."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 100

    import os

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.settings")
    os.environ.setdefault("DEBUG", "1")
    import django

    django.setup()
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from prometheus_client import CollectorRegistry, Histogram

    from disagg_project.telemetry import Tracing

    tracing = Tracing()
    keep = Keep()
    tracing.configure([keep])
    registry = CollectorRegistry()
    ttft = Histogram("ttft_seconds", "", registry=registry, buckets=(0.1, 1, 10))
    duration = Histogram("duration_seconds", "", registry=registry, buckets=(0.1, 1, 10))
    headers = {b"content-type": b"application/json", b"x-api-key": b"sk-x", b"anthropic-version": b"2023-06-01"}
    start_attributes = {"http.request.method": "POST", "url.path": "/v1/messages", "http.route": "/v1/messages",
                        "gateway.request_id": "req_0123456789abcdef01234567", "server.address": "127.0.0.1", "server.port": 8000,
                        "gen_ai.operation.name": "chat"}  # fmt: skip
    end_attributes = {"http.response.status_code": 200, "gen_ai.request.model": "claude-x", "gen_ai.response.model": "claude-x",
                      "gen_ai.request.max_tokens": 4, "gen_ai.response.finish_reasons": ["end_turn"], "gen_ai.usage.input_tokens": 20000,
                      "gen_ai.usage.output_tokens": 4, "gateway.queued_ms": 0.0, "gateway.pool": "pool",
                      "gateway.endpoint.context": "http://10.0.0.1:8001", "gateway.endpoint.generation": "http://10.0.0.2:8002",
                      "gateway.api_key.name": "key", "gateway.priority": "standard", "gateway.stage": "done", "gateway.status": "completed",
                      "gateway.stream": False, "gateway.schedule": "context_first", "gen_ai.provider.name": "trtllm"}  # fmt: skip

    state: dict[str, Any] = {}

    def server_start() -> None:
        state["request"] = tracing.start_request("POST /v1/messages", headers, start_attributes)

    def server_end() -> None:
        tracing.end_request(state["request"], end_attributes)

    def intake() -> None:
        tracing.end(tracing.child("gateway.intake", {"gateway.request.body_bytes": 83000}))

    def worker_calls() -> None:
        for stage, url in (("context", "http://10.0.0.1:8001/v1/chat/completions"), ("generation", "http://10.0.0.2:8002/v1/chat/completions")):
            sent = {"content-type": "application/json"}
            span = tracing.worker_call(stage, "POST", url, sent, {"gateway.stage": stage})
            if stage == "generation":
                tracing.event(span, "gen_ai.first_token")
            tracing.end(span)

    def relay() -> None:
        tracing.end(tracing.child("gateway.relay"))

    def exemplars() -> None:
        exemplar = {"trace_id": "0123456789abcdef0123456789abcdef"}
        ttft.observe(0.05, exemplar)
        duration.observe(0.2, exemplar)

    def no_exemplars() -> None:
        ttft.observe(0.05)
        duration.observe(0.2)

    parts: list[tuple[str, Callable[[], None]]] = [
        ("server span start", server_start), ("intake span (new)", intake), ("worker calls x2", worker_calls),
        ("relay span (new)", relay), ("server span end", server_end), ("histograms, exemplars (new)", exemplars),
        ("histograms, none (off)", no_exemplars),
    ]  # fmt: skip
    best: dict[str, float] = {name: float("inf") for name, _ in parts}
    encode_best: dict[str, float] = {}
    for _ in range(args.rounds):
        spent = dict.fromkeys(best, 0.0)
        for _ in range(args.requests):
            for name, part in parts:
                t0 = time.thread_time()
                part()
                spent[name] += time.thread_time() - t0
        for name in best:
            best[name] = min(best[name], spent[name] / args.requests * 1e6)
        tracing._provider.force_flush()
        by_name: dict[str, list[Any]] = {}
        for span in keep.spans:
            by_name.setdefault(span.name, []).append(span)
        keep.spans.clear()
        for name, spans in by_name.items():
            t0 = time.thread_time()
            encode_spans(spans)
            per_span = (time.thread_time() - t0) / len(spans) * 1e6
            encode_best[name] = min(encode_best.get(name, float("inf")), per_span)
    loop_new = best["intake span (new)"] + best["relay span (new)"] + best["histograms, exemplars (new)"] - best["histograms, none (off)"]
    h.print_table(
        f"The request's thread: µs per traced request, best of {args.rounds} rounds x {args.requests}",
        ["part", "µs"], [[name, value] for name, value in best.items()], digits=1,
    )  # fmt: skip
    h.print_table(
        "The export thread: OTLP encoding, µs per span (best round)", ["span", "µs"],
        [[name, value] for name, value in sorted(encode_best.items())], digits=1,
    )  # fmt: skip
    export_new = encode_best.get("gateway.intake", 0.0) + encode_best.get("gateway.relay", 0.0)
    print(f"\nAdded by the intake and relay spans and the exemplars: {loop_new:.1f} µs on the request's thread, "
          f"{export_new:.1f} µs of encoding on the export thread")  # fmt: skip
    total_loop = sum(v for k, v in best.items() if k != "histograms, none (off)") - best["histograms, none (off)"]
    total_export = sum(encode_best.values())  # one span of each name per request
    print(f"All of a traced request's tracing: {total_loop:.1f} µs on its thread (the histograms' own cost excluded), "
          f"{total_export:.1f} µs of encoding")  # fmt: skip
    tracing.shutdown()


if __name__ == "__main__":
    main()
