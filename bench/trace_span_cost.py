#!/usr/bin/env python
"""What tracing costs per request, in process, with every request sampled: the CPU of the spans a
traced request makes (its own thread) and of their export (the export thread's: OTLP encoding and
the HTTP post), A/B against another checkout's code in the same run.

    .venv/bin/python bench/trace_span_cost.py                       # best of 15 rounds x 300 requests
    .venv/bin/python bench/trace_span_cost.py --quick               # 3 rounds x 100
    .venv/bin/python bench/trace_span_cost.py --root /work/main     # the same, of that checkout's code
    .venv/bin/python bench/trace_span_cost.py --ab /work/main --runs 3   # this, that, this, ... alternately

The request's spans as the gateway makes them, each through the production code: the server span
from `messages_api.request_span.start`/`end` (an audit record like a finished Claude Code
request's); the intake span (`answer._intake`'s calls); the two worker calls (`tracing.worker_call`
with the arguments `workers/wire/client.py` passes, traceparent injected into a header copy, the
first token an event on the generation call); the relay span (`ChatRun.relay`'s); and the two
latency histograms with the trace id as exemplar (`messages_api/metrics.py`), against the same
without. Each part is timed alone with `time.thread_time` (this thread only: other processes' load
does not count). The spans go through the production batch processor to a keeping exporter; then
each round's spans are exported by the exporter the code installs for `OTEL_TRACES_EXPORTER=otlp`
(behind the processor's wrapper, `_CountingExporter`), in batches of 512 (the batch processor's
default), to an OTLP/HTTP sink on a thread of its own, timed on this thread: the export thread's
CPU per request, and of it the encoding alone. Not counted: the admission span, made only when a
request waited for a slot (one more child span).

Prints µs per request per part, best round; `--ab` runs each checkout in a process of its own,
alternately, and prints each run's totals and the best and median per checkout.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
BATCH = 512  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE's default


class Keep:
    """A span exporter that keeps what it is given (exported again later, timed)."""

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


class Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that reads the body and answers 200 (an empty response message)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def measure(rounds: int, requests: int) -> dict[str, Any]:
    """The measurement, of the code importable now (this checkout's, or --root's)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.settings")
    os.environ.setdefault("DEBUG", "1")
    import django

    django.setup()
    from prometheus_client import CollectorRegistry, Histogram

    from disagg_project import telemetry
    from disagg_project.telemetry import Tracing
    from messages_api import request_span
    from messages_api.audit import AuditRecord
    from messages_api.models import RequestStatus
    from workers.admission.queue import Priority

    tracing = Tracing()
    keep = Keep()
    tracing.configure([keep])
    # The seams use the module's facade: this one, for the run.
    telemetry.tracing.__dict__.update(tracing.__dict__)
    facade = telemetry.tracing

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # The exporter reads its endpoint from the environment, as in the gateway.
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    [exporter] = telemetry.exporters_from_environment({"OTEL_TRACES_EXPORTER": "otlp"})
    counted = telemetry._CountingExporter(exporter)
    encode = _encoder_of(exporter)

    registry = CollectorRegistry()
    ttft = Histogram("ttft_seconds", "", registry=registry, buckets=(0.1, 1, 10))
    duration = Histogram("duration_seconds", "", registry=registry, buckets=(0.1, 1, 10))
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "server": ("127.0.0.1", 8000)}
    headers = {b"content-type": b"application/json", b"x-api-key": b"sk-x", b"anthropic-version": b"2023-06-01"}
    # As workers/wire/client.py calls it: the stage as an attribute where the call site still passes one.
    stage_attribute = inspect.signature(Tracing.worker_call).parameters["attributes"].default is inspect.Parameter.empty

    class Pool:
        schedule_style = "context_first"
        protocol = "trtllm"

    class Run:
        pool = Pool()

    state: dict[str, Any] = {}

    def finished_record() -> AuditRecord:
        """What the gateway's record of a finished request holds (made untimed: it is not tracing's)."""
        record = AuditRecord(route="POST /v1/messages")
        record.http_status, record.model, record.stream, record.max_tokens = 200, "claude-x", False, 4
        record.status, record.stage, record.stop_reason = RequestStatus.COMPLETED, "done", "end_turn"
        record.input_tokens, record.output_tokens, record.cache_read_input_tokens = 20000, 4, 0
        record.queued_ms, record.pool_name, record.api_key_name, record.priority = 0.0, "pool", "key", Priority.STANDARD
        record.context_endpoint, record.generation_endpoint = "http://10.0.0.1:8001", "http://10.0.0.2:8002"
        record.run, record.ended = Run(), True  # type: ignore[assignment]  # the two attributes the span reads
        return record

    def server_start() -> None:
        state["request"] = request_span.start(scope, headers, state["record"])

    def server_end() -> None:
        request_span.end(state["request"], state["record"])

    def intake() -> None:
        facade.end(facade.child("gateway.intake", {"gateway.request.body_bytes": 83000}))

    def worker_calls() -> None:
        for stage, url in (("context", "http://10.0.0.1:8001/v1/chat/completions"), ("generation", "http://10.0.0.2:8002/v1/chat/completions")):
            sent = dict({"content-type": "application/json"})
            if stage_attribute:
                span = facade.worker_call(stage, "POST", url, sent, {"gateway.stage": stage})
            else:
                span = facade.worker_call(stage, "POST", url, sent)
            if stage == "generation":
                facade.event(span, "gen_ai.first_token")
            facade.end(span)

    def relay() -> None:
        facade.end(facade.child("gateway.relay"))

    def exemplars() -> None:
        exemplar = {"trace_id": state["request"].trace_id}
        ttft.observe(0.05, exemplar)
        duration.observe(0.2, exemplar)

    def no_exemplars() -> None:
        ttft.observe(0.05)
        duration.observe(0.2)

    parts: list[tuple[str, Callable[[], None]]] = [
        ("server span start", server_start), ("intake span", intake), ("worker calls x2", worker_calls),
        ("relay span", relay), ("histograms, exemplars", exemplars), ("server span end", server_end),
        ("histograms, none (off)", no_exemplars),
    ]  # fmt: skip
    best: dict[str, float] = {name: float("inf") for name, _ in parts}
    best_encode = best_export = float("inf")
    spans_per_request = 0.0
    for _ in range(rounds):
        spent = dict.fromkeys(best, 0.0)
        for _ in range(requests):
            state["record"] = finished_record()
            for name, part in parts:
                t0 = time.thread_time()
                part()
                spent[name] += time.thread_time() - t0
        for name in best:
            best[name] = min(best[name], spent[name] / requests * 1e6)
        facade._provider.force_flush()
        spans, keep.spans = keep.spans, []
        spans_per_request = len(spans) / requests
        batches = [spans[i : i + BATCH] for i in range(0, len(spans), BATCH)]
        t0 = time.thread_time()
        for batch in batches:
            encode(batch)
        best_encode = min(best_encode, (time.thread_time() - t0) / requests * 1e6)
        t0 = time.thread_time()
        for batch in batches:
            counted.export(list(batch))  # a copy: the wrapper empties what it is given
        best_export = min(best_export, (time.thread_time() - t0) / requests * 1e6)
    facade.shutdown()
    exporter.shutdown()
    server.shutdown()
    request_thread = sum(v for k, v in best.items() if k != "histograms, none (off)") - best["histograms, none (off)"]
    return {
        "parts": best,
        "request_thread": request_thread,
        "encode": best_encode,
        "export": best_export,
        "total": request_thread + best_export,
        "spans_per_request": spans_per_request,
        "exporter": f"{type(exporter).__module__}.{type(exporter).__name__}",
    }


def _encoder_of(exporter: Any) -> Callable[[Sequence[Any]], bytes]:
    """The encoding step of `exporter.export`: the gateway's own encoder where it installs it,
    else the official encoder and its serialization."""
    if type(exporter).__module__ == "disagg_project.otlp_exporter":
        from disagg_project.otlp_encoding import encode_spans

        return encode_spans
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as official

    def encode(spans: Sequence[Any]) -> bytes:
        serialized: bytes = official(spans).SerializePartialToString()
        return serialized

    return encode


def print_result(result: dict[str, Any], rounds: int, requests: int, h: Any) -> None:
    h.print_table(
        f"The request's thread: µs per traced request, best of {rounds} rounds x {requests}",
        ["part", "µs"], [[name, value] for name, value in result["parts"].items()], digits=1,
    )  # fmt: skip
    print(f"\nspans per request: {result['spans_per_request']:.0f}; exporter: {result['exporter']}")
    print(f"request's thread (the histograms' own cost excluded): {result['request_thread']:.1f} µs")
    print(f"export thread: {result['export']:.1f} µs (of which encoding {result['encode']:.1f} µs; "
          f"batches of {BATCH}, posted to a sink on this machine)")  # fmt: skip
    print(f"all of a traced request's tracing: {result['total']:.1f} µs of CPU")


def ab(other: Path, runs: int, extra: list[str], h: Any) -> None:
    """Each checkout measured in a process of its own, alternately, `runs` times each."""
    roots = {"this": h.PROJECT_ROOT, "other": other.resolve()}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in roots}
    for run in range(runs):
        for name, root in roots.items():
            command = [sys.executable, str(HERE), "--root", str(root), "--json", *extra]
            output = subprocess.run(command, cwd=root, check=True, capture_output=True, text=True).stdout
            result = json.loads(output.strip().splitlines()[-1])
            results[name].append(result)
            print(f"run {run + 1} {name:5s} ({root}): request thread {result['request_thread']:6.1f}  encoding {result['encode']:6.1f}  "
                  f"export {result['export']:6.1f}  total {result['total']:6.1f} µs  ({result['exporter']})", flush=True)  # fmt: skip
    rows = []
    for name in roots:
        for key in ("request_thread", "encode", "export", "total"):
            values = [r[key] for r in results[name]]
            rows.append([name, key, min(values), statistics.median(values)])
    h.print_table(f"µs per traced request, {runs} runs each (best round of each run)", ["checkout", "what", "best", "median"], rows, digits=1)
    parts = list(results["this"][0]["parts"])
    h.print_table(
        "The request's thread by part, median of the runs' best rounds", ["part", "this", "other"],
        [[p, statistics.median(r["parts"][p] for r in results["this"]), statistics.median(r["parts"][p] for r in results["other"])] for p in parts],
        digits=1,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--root", type=Path, help="measure the code of this checkout of the project")
    parser.add_argument("--ab", type=Path, metavar="ROOT", help="A/B: this checkout against ROOT's, alternately")
    parser.add_argument("--runs", type=int, default=3, help="--ab: runs per checkout (default 3)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 100
    # The checkout whose code is measured goes first on the import path; the harness (which
    # imports parts of the project) only after the measurement, or in the A/B driver, which
    # measures nothing itself.
    sys.path.insert(0, str((args.root or HERE.parents[1]).resolve()))
    sys.path.insert(1, str(HERE.parent))
    if args.ab is not None:
        import harness as h

        ab(args.ab, args.runs, ["--rounds", str(args.rounds), "--requests", str(args.requests)], h)
        return
    result = measure(args.rounds, args.requests)
    if args.json:
        print(json.dumps(result))
    else:
        import harness as h

        print_result(result, args.rounds, args.requests, h)


if __name__ == "__main__":
    main()
