#!/usr/bin/env python
"""Relay latency and throughput of streamed requests.

    .venv/bin/python bench/relay.py                 # both parts, default sizes
    .venv/bin/python bench/relay.py --part latency --samples 1000
    .venv/bin/python bench/relay.py --part throughput --streams 64 --tokens 4000 --rounds 2
    .venv/bin/python bench/relay.py --quick         # smoke test, a few seconds

(a) latency: one request at a time, time to the first content event: the first
`content_block_delta` through the gateway, and the first content chunk of a plain (aggregated)
OpenAI chat streaming request sent straight to the sim generation worker. Three kinds of request
are interleaved (in a shuffled order each round) so they see the same machine state:

    gateway, disaggregated    pool `bench` (context first, conditional disaggregation off): the
                              request also pays the context phase (a POST to the context worker,
                              then the generation worker takes the KV from it)
    gateway, aggregated path  pool `bench-agg` (model `sim-model-agg`) whose
                              max_local_prefill_tokens is large: the context phase is skipped and
                              the request goes whole to the generation worker, as the direct call
    direct                    the same chat request straight to the generation worker

Each kind uses one keep-alive connection. Targets (gateway, aggregated path − direct): added p50
≤ 2 ms, added p99 ≤ 5 ms.

(b) throughput: K concurrent streams of M tokens each (`[sim tokens=M]`, sim workers unpaced),
each of the K connections running R such streams back to back. Content events per second
delivered to the clients and gateway CPU µs per relayed event; the same load sent straight to
the generation worker is the baseline (what the sim and the client manage on this machine).
Targets: ≥ 30,000 events/s, ≤ 30 µs gateway CPU per event.

(c) paced (`--part paced`): production's shape. A real decode worker sends one token every
~10–50 ms per stream, so every token is its own read from the worker and its own write to the
client. Sim workers started with `--tokens-per-second 1000/ms_per_token` (default one token per
20 ms); at each offered load L events/s (default 2,500 / 10,000 / 20,000 / 40,000), L × ms/1000
connections each run closed-loop streams of `--paced-tokens` (256) tokens back to back for
`--paced-seconds`, their starts spread over one stream's duration so they do not tick in step.
Through the gateway (aggregated path: the context phase skipped) and straight to the worker, in
turn: content events/s delivered in the steady window (after the ramp), gateway CPU µs per
relayed event, status line and first content event p50/p99, the largest gap between two content
reads of a stream (p50/p99 over streams). Targets (issue 12): at 10,000 ev/s ≤ 35 µs CPU per
event and status/first content p99 ≤ 60 ms; at 2,500 ev/s ≤ 60 µs and first content p99 ≤ 50 ms.
Beside them, in the same run: the Rust routers (`--routers`) and the floor of a Python relay
(`--floors`: bench/floor_proxy.py, plain asyncio, bytes through or the least reframing work).

With `--burst` (issue 30) the paced streams start together instead of ramping, and, all of one
length, end together and start together again: first content p50/p99 over every stream, and per
burst the time until its last stream's first content event.

    .venv/bin/python bench/relay.py --part paced --burst --paced-loads 10000 --routers vllm-router,sglang-router
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

ADDED_P50_TARGET_MS = 2.0
ADDED_P99_TARGET_MS = 5.0
EVENTS_TARGET = 30_000.0
CPU_PER_EVENT_TARGET_US = 30.0
AGG_MODEL = "sim-model-agg"
PACED_MODEL = "sim-model-paced"
# Offered events/s → (CPU µs per event, status line and first content p99 ms) targets.
PACED_TARGETS: dict[int, tuple[float, float]] = {10_000: (35.0, 60.0), 2_500: (60.0, 50.0)}
GATEWAY_CONTENT = b"event: content_block_delta"
DIRECT_CONTENT = b'"delta":{"content"'


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("both", "latency", "throughput", "paced", "all"), default="both",
                        help="both = latency + throughput (unpaced); all = both + paced")
    parser.add_argument("--samples", type=int, help="latency rounds, each one request of every kind (default 500; --quick 40)")
    parser.add_argument("--warmup", type=int, help="latency rounds not counted (default 30; --quick 5)")
    parser.add_argument("--latency-tokens", type=int, default=16, help="tokens per latency request (default 16)")
    parser.add_argument("--streams", type=int, help="K concurrent streams (default 32; --quick 8)")
    parser.add_argument("--tokens", type=int, help="M tokens per stream (default 4000; --quick 500)")
    parser.add_argument("--rounds", type=int, help="R streams per connection, back to back (default 3; --quick 1)")
    parser.add_argument("--no-direct-throughput", action="store_true", help="skip the direct throughput baseline")
    parser.add_argument("--paced-loads", help="offered loads, events/s, comma-separated (default 2500,10000,20000,40000; --quick 2500)")
    parser.add_argument("--ms-per-token", type=float, default=20.0, help="paced: ms between two tokens of a stream (default 20)")
    parser.add_argument("--paced-tokens", type=int, help="paced: tokens per stream (default 256; --quick 64)")
    parser.add_argument("--paced-seconds", type=float, help="paced: seconds per load level and target (default 25; --quick 5)")
    parser.add_argument("--burst", action="store_true",
                        help="paced: every stream starts at once (no ramp), and, all of one length, they end together and "
                             "start together again: bursts, as when a team starts work, after a restart or after a 529")
    parser.add_argument("--gateway-processes", type=int, default=1,
                        help="daphne processes of the gateway (and of gateway B), as `manage.py serve --processes N` runs "
                        "them in production: a socket each with SO_REUSEPORT (default 1; its CPU figures are their sum)")
    parser.add_argument("--shared-socket", action="store_true",
                        help="the gateway's processes share one listening socket (`serve --shared-socket`)")
    parser.add_argument("--b-shared-socket", action="store_true",
                        help="paced: A/B, gateway B's processes share one listening socket; with no --b-root, B runs from "
                        "this checkout")
    parser.add_argument("--b-root", type=Path,
                        help="paced: A/B, a second gateway ('gateway B') run from this checkout of the project (another "
                        "commit), in front of the same workers and database; measured right after gateway A at every level")
    parser.add_argument("--b-env", action="append", default=[], metavar="KEY=VALUE",
                        help="paced: A/B, a setting of gateway B (repeatable); with no --b-root, B runs from this checkout")
    parser.add_argument("--routers", default="",
                        help="paced: also measure these Rust routers (comma-separated: vllm-router,sglang-router), each "
                        "in its regular mode in front of the same paced worker, right after the gateways at every level")
    parser.add_argument("--floors", default="",
                        help="paced: also measure these Python floor proxies (bench/floor_proxy.py; comma-separated: "
                        "pipe,reframe,pipe-uvloop,reframe-uvloop; framework: daphne and Channels relaying over aiohttp, "
                        "bench/framework_floor.py) in front of the same paced worker, after the routers")
    parser.add_argument("--repeat", type=int, default=1,
                        help="paced: run every level this many times (A and B alternate which goes first; default 1)")
    args = h.parse_args(
        parser,
        quick={"samples": 40, "warmup": 5, "streams": 8, "tokens": 500, "rounds": 1,
               "paced_loads": "2500", "paced_tokens": 64, "paced_seconds": 5.0},
        full={"samples": 500, "warmup": 30, "streams": 32, "tokens": 4000, "rounds": 3,
              "paced_loads": "2500,10000,20000,40000", "paced_tokens": 256, "paced_seconds": 25.0},
    )
    return args


def direct_payload(directive: str, max_tokens: int = 100000) -> dict[str, Any]:
    return {
        "model": h.MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": f"Hello {directive}"}],
    }


# --- (a) latency -----------------------------------------------------------------------------------


async def latency(args: argparse.Namespace, gateway: h.GatewayProc, key: str, gen: h.SimProc, sims: list[h.SimProc]) -> dict[str, Any]:
    gport = gateway.port
    dport = h.port_of(gen.url)
    directive = f"[sim tokens={args.latency_tokens}]"
    wires = {
        "gateway, disaggregated": (gport, h.gateway_request(gport, key, h.messages_body(directive, stream=True)), GATEWAY_CONTENT),
        "gateway, aggregated path": (
            gport,
            h.gateway_request(gport, key, h.messages_body(directive, stream=True, model=AGG_MODEL)),
            GATEWAY_CONTENT,
        ),
        "direct": (dport, h.worker_request(dport, direct_payload(directive)), DIRECT_CONTENT),
    }
    conns = {kind: h.KeepAlive(port) for kind, (port, _, _) in wires.items()}
    ttft: dict[str, list[float]] = {kind: [] for kind in wires}
    total: dict[str, list[float]] = {kind: [] for kind in wires}
    added: dict[str, list[float]] = {"gateway, disaggregated": [], "gateway, aggregated path": []}
    failures: dict[str, int] = {kind: 0 for kind in wires}
    kinds = list(wires)
    rng = random.Random(1)
    meter = h.CpuMeter({"gateway": gateway.pids, **{s.name: s.pid for s in sims}})
    for i in range(args.warmup + args.samples):
        if i == args.warmup:
            meter.start()
        rng.shuffle(kinds)
        this: dict[str, float] = {}
        for kind in kinds:
            _, wire, pattern = wires[kind]
            resp = await conns[kind].request(wire, count=pattern)
            if resp.status != 200 or resp.first_count_at is None or resp.error:
                failures[kind] += 1
                continue
            this[kind] = resp.first_count_at - resp.sent_at
            if i >= args.warmup:
                ttft[kind].append(this[kind])
                total[kind].append((resp.done_at or resp.first_count_at) - resp.sent_at)
        if i >= args.warmup and "direct" in this:
            for kind in added:
                if kind in this:
                    added[kind].append(this[kind] - this["direct"])
        # A short pause so each request meets an idle machine, as a lone request would.
        await asyncio.sleep(0.002)
    cpu = meter.stop()
    for conn in conns.values():
        conn.close()
    machine_latency = meter.machine_note()

    dists = {kind: h.distribution(v) for kind, v in ttft.items()}
    added_dists = {kind: h.distribution(v) for kind, v in added.items()}
    total_dists = {kind: h.distribution(v) for kind, v in total.items()}
    h.print_distributions(
        f"(a) time to first content event, ms ({args.samples} rounds, one request at a time, interleaved)",
        [(kind, dists[kind]) for kind in wires],
        unit_scale=1000,
        digits=3,
    )
    print(f"({machine_latency})")
    h.print_distributions(
        "(a) added by the gateway: gateway − direct in the same round, ms",
        [(kind, d) for kind, d in added_dists.items()],
        unit_scale=1000,
        digits=3,
    )
    h.print_distributions(
        f"(a) time to the end of the response ({args.latency_tokens} tokens), ms",
        [(kind, total_dists[kind]) for kind in wires],
        unit_scale=1000,
        digits=3,
    )
    rounds = max(args.samples, 1)
    gateway_requests = 2 * rounds
    loop_us = cpu["gateway:loop-thread"] / gateway_requests * 1e6
    print(f"\ngateway CPU per request (both gateway kinds): {cpu['gateway'] / gateway_requests * 1e6:,.0f} µs "
          f"(event-loop thread {loop_us:,.0f} µs, other threads — audit writer, executor — "
          f"{cpu['gateway'] / gateway_requests * 1e6 - loop_us:,.0f} µs); failures: {failures}")
    agg, agg_p50 = added_dists["gateway, aggregated path"], None
    if dists["gateway, aggregated path"].get("n") and dists["direct"].get("n"):
        agg_p50 = (dists["gateway, aggregated path"]["p50"] - dists["direct"]["p50"]) * 1000
    agg_p99 = (dists["gateway, aggregated path"]["p99"] - dists["direct"]["p99"]) * 1000 if agg_p50 is not None else None
    checks = {
        "added_p50_ms": {"value": agg_p50, "paired_p50": agg.get("p50", 0) * 1000, "target": ADDED_P50_TARGET_MS,
                          "ok": agg_p50 is not None and agg_p50 <= ADDED_P50_TARGET_MS},
        "added_p99_ms": {"value": agg_p99, "paired_p99": agg.get("p99", 0) * 1000, "target": ADDED_P99_TARGET_MS,
                          "ok": agg_p99 is not None and agg_p99 <= ADDED_P99_TARGET_MS},
    }
    disagg = dists["gateway, disaggregated"]
    h.print_table(
        "(a) targets: gateway (aggregated path) vs direct, ms",
        ("", "gateway p − direct p", "paired difference", "target", ""),
        [
            ["added p50", agg_p50 if agg_p50 is not None else float("nan"), agg.get("p50", float("nan")) * 1000,
             f"<= {ADDED_P50_TARGET_MS:g}", h.verdict(checks["added_p50_ms"]["ok"])],
            ["added p99", agg_p99 if agg_p99 is not None else float("nan"), agg.get("p99", float("nan")) * 1000,
             f"<= {ADDED_P99_TARGET_MS:g}", h.verdict(checks["added_p99_ms"]["ok"])],
            ["(disaggregated) added p50",
             (disagg.get("p50", float("nan")) - dists["direct"].get("p50", float("nan"))) * 1000,
             added_dists["gateway, disaggregated"].get("p50", float("nan")) * 1000, "(context phase included)", ""],
        ],
        digits=3,
    )
    return {
        "samples": args.samples,
        "tokens": args.latency_tokens,
        "time_to_first_content_ms": {k: h.in_ms(v) for k, v in dists.items()},
        "added_ms": {k: h.in_ms(v) for k, v in added_dists.items()},
        "time_to_end_ms": {k: h.in_ms(v) for k, v in total_dists.items()},
        "cpu_s": cpu,
        "gateway_cpu_us_per_request": cpu["gateway"] / gateway_requests * 1e6,
        "gateway_loop_thread_cpu_us_per_request": loop_us,
        "failures": failures,
        "checks": checks,
        "machine": machine_latency,
    }


# --- (b) throughput -------------------------------------------------------------------------------


async def _drive(port: int, wire: bytes, pattern: bytes, streams: int, rounds: int) -> tuple[int, int, list[float], int]:
    """K connections, R streams each; returns (events, bytes, per-stream seconds, failures)."""
    counts = [0]
    durations: list[float] = []
    failures = [0]

    async def one_connection() -> None:
        conn = h.KeepAlive(port)
        try:
            for _ in range(rounds):
                resp = await conn.request(wire, count=pattern)
                if resp.status != 200 or resp.error:
                    failures[0] += 1
                counts[0] += resp.count
                if resp.done_at is not None:
                    durations.append(resp.done_at - resp.sent_at)
        finally:
            conn.close()

    await asyncio.gather(*(one_connection() for _ in range(streams)))
    return counts[0], 0, durations, failures[0]


async def throughput(args: argparse.Namespace, gateway: h.GatewayProc, key: str, gen: h.SimProc, sims: list[h.SimProc]) -> dict[str, Any]:
    gport = gateway.port
    dport = h.port_of(gen.url)
    directive = f"[sim tokens={args.tokens}]"
    gw_wire = h.gateway_request(gport, key, h.messages_body(directive, stream=True))
    direct_wire = h.worker_request(dport, direct_payload(directive))
    expected = args.streams * args.rounds * args.tokens
    pids: dict[str, int | list[int]] = {"gateway": gateway.pids, **{s.name: s.pid for s in sims}}

    # Warm up the gateway's upstream connection pool and code paths.
    await _drive(gport, h.gateway_request(gport, key, h.messages_body("[sim tokens=64]", stream=True)), GATEWAY_CONTENT, args.streams, 1)

    results: dict[str, Any] = {}
    runs = [("gateway", gport, gw_wire, GATEWAY_CONTENT)]
    if not args.no_direct_throughput:
        runs.append(("direct", dport, direct_wire, DIRECT_CONTENT))
    for label, port, wire, pattern in runs:
        meter = h.CpuMeter(pids).start()
        events, _, durations, failures = await _drive(port, wire, pattern, args.streams, args.rounds)
        cpu = meter.stop()
        wall = meter.wall
        results[label] = {
            "events": events,
            "expected_events": expected,
            "failures": failures,
            "wall_s": wall,
            "events_per_s": events / wall if wall else 0.0,
            "cpu_s": cpu,
            "cpu_util": {k: v / wall for k, v in cpu.items()},
            "stream_duration_s": h.distribution(durations),
            "machine": meter.machine_note(),
        }
        if label == "gateway":
            results[label]["gateway_cpu_us_per_event"] = cpu["gateway"] / events * 1e6 if events else float("nan")

    rows = []
    for label, r in results.items():
        rows.append([
            label,
            r["events"],
            r["wall_s"],
            r["events_per_s"],
            r["cpu_s"]["gateway"] / r["events"] * 1e6 if r["events"] else float("nan"),
            r["cpu_s"]["gateway:loop-thread"] / r["events"] * 1e6 if r["events"] else float("nan"),
            r["cpu_util"]["gateway"] * 100,
            r["cpu_util"].get("sim-generation", 0) * 100,
            r["cpu_util"].get("sim-context", 0) * 100,
            r["cpu_util"]["loadgen"] * 100,
        ])
    h.print_table(
        f"(b) throughput: {args.streams} concurrent streams × {args.tokens} tokens × {args.rounds} rounds",
        ("", "content events", "wall s", "events/s", "gw CPU µs/event", "of which loop thread",
         "gw CPU %", "sim-gen CPU %", "sim-ctx CPU %", "loadgen CPU %"),
        rows,
        digits=1,
    )
    for label, r in results.items():
        print(f"({label}: {r['machine']})")
    g = results["gateway"]
    checks = {
        "events_per_s": {"value": g["events_per_s"], "target": EVENTS_TARGET, "ok": g["events_per_s"] >= EVENTS_TARGET},
        "gateway_cpu_us_per_event": {"value": g["gateway_cpu_us_per_event"], "target": CPU_PER_EVENT_TARGET_US,
                                     "ok": g["gateway_cpu_us_per_event"] <= CPU_PER_EVENT_TARGET_US},
        "all_events_delivered": {"value": g["events"], "target": expected, "ok": g["events"] == expected and g["failures"] == 0},
    }
    h.print_table(
        "(b) targets",
        ("", "measured", "target", ""),
        [
            ["content events/s through the gateway", g["events_per_s"], f">= {EVENTS_TARGET:,.0f}", h.verdict(checks["events_per_s"]["ok"])],
            ["gateway CPU per relayed event, µs", g["gateway_cpu_us_per_event"], f"<= {CPU_PER_EVENT_TARGET_US:g}",
             h.verdict(checks["gateway_cpu_us_per_event"]["ok"])],
            ["events delivered / expected", f"{g['events']} / {expected}", "all", h.verdict(checks["all_events_delivered"]["ok"])],
        ],
        digits=1,
    )
    return {"streams": args.streams, "tokens": args.tokens, "rounds": args.rounds, "runs": results, "checks": checks}


# --- (c) paced ------------------------------------------------------------------------------------


async def _drive_paced(port: int, wire: bytes, pattern: bytes, streams: int, seconds: float, ramp: float) -> dict[str, Any]:
    """`streams` connections, each running streams back to back until `seconds` have passed,
    the first of each starting at an even offset within `ramp` (0: all at once). `rounds[k]` holds
    every connection's k-th stream (a burst, when they start together)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_at = start + seconds
    responses: list[h.Response] = []
    rounds: dict[int, list[h.Response]] = {}

    async def one_connection(index: int) -> None:
        if ramp:
            await asyncio.sleep(ramp * index / streams)
        conn = h.KeepAlive(port)
        try:
            k = 0
            while loop.time() < stop_at:
                response = await conn.request(wire, count=pattern, count_times=True)
                responses.append(response)
                rounds.setdefault(k, []).append(response)
                k += 1
        finally:
            conn.close()

    await asyncio.gather(*(one_connection(i) for i in range(streams)))
    return {"responses": responses, "start": start, "rounds": rounds}


def _burst_summary(rounds: dict[int, list[h.Response]], streams: int) -> dict[str, Any]:
    """Per burst (a round every connection ran in full): from its first request sent to its last
    stream's first content event, the time until everyone has started."""
    spans = []
    for responses in rounds.values():
        if len(responses) < streams or any(r.first_count_at is None for r in responses):
            continue
        spans.append(max(r.first_count_at for r in responses if r.first_count_at is not None) - min(r.sent_at for r in responses))
    return {"bursts": len(spans), "last_first_content_s": h.distribution(spans)}


def _paced_summary(responses: list[h.Response], window: tuple[float, float]) -> dict[str, Any]:
    lo, hi = window
    in_window = sum(1 for r in responses for t in (r.count_times or ()) if lo <= t < hi)
    ok = [r for r in responses if r.status == 200 and not r.error and r.first_count_at is not None]
    ok_ids = {id(r) for r in ok}
    failed = [r for r in responses if id(r) not in ok_ids]
    return {
        "streams_run": len(responses),
        "failures": len(responses) - len(ok),
        # What failed, for a look at the gateway's log (--keep): status, client-side error, and
        # whether any content arrived.
        "failure_examples": [{"status": r.status, "error": r.error, "events": r.count} for r in failed[:5]],
        "events": sum(r.count for r in responses),
        "window_events_per_s": in_window / (hi - lo) if hi > lo else float("nan"),
        "status_line_s": h.distribution(r.status_at - r.sent_at for r in ok if r.status_at is not None),
        "first_content_s": h.distribution(r.first_count_at - r.sent_at for r in ok if r.first_count_at is not None),
        "max_gap_s": h.distribution(r.max_count_gap for r in ok),
    }


async def paced(
    args: argparse.Namespace, gateways: dict[str, h.GatewayProc], key: str, gen: h.SimProc,
    routers: dict[str, h.RouterProc], floors: dict[str, h.RouterProc | h.GatewayProc],
) -> dict[str, Any]:
    """`gateways`: "gateway" and, for an A/B, "gateway B"; `routers`: the Rust routers, by name;
    `floors`: the floor proxies (bench/floor_proxy.py), by label ("floor pipe", ...). Every
    target's process is metered as the proxy (none for the worker called directly)."""
    dport = h.port_of(gen.url)
    directive = f"[sim tokens={args.paced_tokens}]"
    direct_wire = h.worker_request(dport, {**direct_payload(directive), "model": h.MODEL})
    stream_s = args.paced_tokens * args.ms_per_token / 1000
    ramp = 0.0 if args.burst else min(stream_s, args.paced_seconds / 3)
    loads = [int(x) for x in str(args.paced_loads).split(",") if x.strip()]
    targets: dict[str, tuple[int, bytes, bytes, dict[str, int | list[int]]]] = {}
    for label, gateway in gateways.items():
        gport = gateway.port
        gw_wire = h.gateway_request(gport, key, h.messages_body(directive, stream=True, model=PACED_MODEL))
        targets[label] = (gport, gw_wire, GATEWAY_CONTENT, {"gateway": gateway.pids, "sim-generation": gen.pid})
        # Warm the gateway's pools and code paths.
        await _drive(gport, h.gateway_request(gport, key, h.messages_body("[sim tokens=4]", stream=True, model=PACED_MODEL)), GATEWAY_CONTENT, 8, 1)
    for label, router in routers.items():
        # The same chat request as the direct call; the router passes the worker's bytes through.
        targets[label] = (router.port, h.worker_request(router.port, {**direct_payload(directive), "model": h.MODEL}),
                          DIRECT_CONTENT, {"router": router.pid, "sim-generation": gen.pid})
        await _drive(router.port, h.worker_request(router.port, direct_payload("[sim tokens=4]")), DIRECT_CONTENT, 8, 1)
    for label, floor in floors.items():
        if label.startswith("floor pipe"):
            # Like the routers: the chat request, the worker's bytes back unchanged.
            wire = h.worker_request(floor.port, {**direct_payload(directive), "model": h.MODEL})
            warm = h.worker_request(floor.port, direct_payload("[sim tokens=4]"))
            pattern = DIRECT_CONTENT
        else:
            # The gateway's Anthropic request (the worker's model name: no pool to map it), counted
            # as the gateway is.
            wire = h.gateway_request(floor.port, key, h.messages_body(directive, stream=True))
            warm = h.gateway_request(floor.port, key, h.messages_body("[sim tokens=4]", stream=True))
            pattern = GATEWAY_CONTENT
        targets[label] = (floor.port, wire, pattern, {"floor": floor.pid, "sim-generation": gen.pid})
        await _drive(floor.port, warm, pattern, 8, 1)
    targets["direct"] = (dport, direct_wire, DIRECT_CONTENT, {"sim-generation": gen.pid})
    levels: list[dict[str, Any]] = []
    rows = []
    for load, repetition in ((load, r) for load in loads for r in range(args.repeat)):
        streams = max(1, round(load * args.ms_per_token / 1000))
        level: dict[str, Any] = {"offered_events_per_s": load, "streams": streams, "repetition": repetition}
        order = [label for label in gateways]
        if repetition % 2:
            order.reverse()  # A/B: each goes first as often as the other
        for label in order + list(routers) + list(floors) + ["direct"]:
            port, wire, pattern, pids = targets[label]
            meter = h.CpuMeter(pids).start()
            run = await _drive_paced(port, wire, pattern, streams, args.paced_seconds, ramp)
            cpu = meter.stop()
            window = (run["start"] + ramp + 1.0, run["start"] + args.paced_seconds)
            summary = _paced_summary(run["responses"], window)
            if args.burst:
                summary["burst"] = _burst_summary(run["rounds"], streams)
            summary["cpu_s"] = cpu
            summary["cpu_util"] = {k: v / meter.wall for k, v in cpu.items()}
            events = summary["events"] or float("nan")
            proxy = next((name for name in ("gateway", "router", "floor") if name in pids), None)
            # The proxy's CPU per event (nan for the worker called directly), and the worker's.
            summary["proxy_cpu_us_per_event"] = cpu[proxy] / events * 1e6 if proxy else float("nan")
            if proxy == "gateway":
                summary["gateway_cpu_us_per_event"] = summary["proxy_cpu_us_per_event"]
            summary["worker_cpu_us_per_event"] = cpu["sim-generation"] / events * 1e6
            summary["machine"] = meter.machine_note()
            level[label] = summary
            rows.append([
                f"{load:,} ev/s, {label}" + (f" #{repetition + 1}" if args.repeat > 1 else ""),
                summary["window_events_per_s"],
                summary["proxy_cpu_us_per_event"],
                cpu[f"{proxy}:kernel"] / events * 1e6 if proxy else float("nan"),
                cpu["gateway:loop-thread"] / events * 1e6 if proxy == "gateway" else float("nan"),
                summary["worker_cpu_us_per_event"],
                summary["cpu_util"][proxy] * 100 if proxy else float("nan"),
                summary["status_line_s"].get("p50", float("nan")) * 1000,
                summary["status_line_s"].get("p99", float("nan")) * 1000,
                summary["first_content_s"].get("p50", float("nan")) * 1000,
                summary["first_content_s"].get("p99", float("nan")) * 1000,
                summary["max_gap_s"].get("p99", float("nan")) * 1000,
                summary["failures"],
                cpu["others"] / meter.wall,
                *([summary["burst"]["last_first_content_s"].get("p50", float("nan")) * 1000,
                   summary["burst"]["last_first_content_s"].get("max", float("nan")) * 1000] if args.burst else []),
            ])
        target = PACED_TARGETS.get(load)
        if target is not None:
            level["checks"] = {}
            for label in gateways:
                g = level[label]
                prefix = "" if label == "gateway" else f"{label}: "
                cpu_target, p99_target = target
                p99 = max(g["status_line_s"].get("p99", float("inf")), g["first_content_s"].get("p99", float("inf"))) * 1000
                level["checks"].update({
                    prefix + "gateway_cpu_us_per_event": {"value": g["gateway_cpu_us_per_event"], "target": cpu_target,
                                                          "ok": g["gateway_cpu_us_per_event"] <= cpu_target},
                    prefix + "status_and_first_content_p99_ms": {"value": p99, "target": p99_target, "ok": p99 <= p99_target},
                    prefix + "delivered_vs_direct": {
                        "value": g["window_events_per_s"], "target": level["direct"]["window_events_per_s"],
                        "ok": g["failures"] == 0 and g["window_events_per_s"] >= 0.97 * level["direct"]["window_events_per_s"]},
                })
        levels.append(level)
    h.print_table(
        f"(c) paced: one token every {args.ms_per_token:g} ms per stream, {args.paced_tokens}-token streams, "
        f"{args.paced_seconds:g} s per run "
        + ("(bursts: every stream starts together, again at each stream's end)" if args.burst else f"(steady window after a {ramp:.1f} s ramp)"),
        ("", "events/s delivered", "proxy CPU µs/event", "of which kernel", "of which loop thread", "worker CPU µs/event",
         "proxy CPU %", "status p50 ms", "status p99 ms",
         "first content p50 ms", "first content p99 ms", "max gap p99 ms", "failures", "others' cores",
         *(("last stream's first content p50 ms", "... max ms") if args.burst else ())),
        rows,
        digits=1,
    )
    check_rows = []
    for level in levels:
        for name, check in level.get("checks", {}).items():
            check_rows.append([f"{level['offered_events_per_s']:,} ev/s: {name}", check["value"], check["target"], h.verdict(check["ok"])])
    if check_rows:
        h.print_table("(c) targets", ("", "measured", "target", ""), check_rows, digits=1)
    for level in levels:
        for label in gateways:
            print(f"({level['offered_events_per_s']:,} ev/s, {label}: {level[label]['machine']})")
    for level in levels:
        for label in [*routers, *floors]:
            print(f"({level['offered_events_per_s']:,} ev/s, {label}: {level[label]['machine']})")
    return {"ms_per_token": args.ms_per_token, "tokens": args.paced_tokens, "seconds": args.paced_seconds, "burst": args.burst,
            "b_root": str(args.b_root) if args.b_root else None, "b_env": args.b_env, "routers": list(routers), "floors": list(floors),
            "levels": levels}


async def run(
    args: argparse.Namespace, gateway: h.GatewayProc, key: str, gen: h.SimProc, sims: list[h.SimProc],
    paced_gen: h.SimProc | None, gateway_b: h.GatewayProc | None, routers: dict[str, h.RouterProc],
    floors: dict[str, h.RouterProc | h.GatewayProc],
) -> dict[str, Any]:
    out: dict[str, Any] = {"config": { "gateway_nodelay": args.gateway_nodelay}}
    out["quiet"] = h.wait_for_quiet(args.quiet_wait)
    if args.part in ("both", "all", "latency"):
        out["latency"] = await latency(args, gateway, key, gen, sims)
    if args.part in ("both", "all", "throughput"):
        out["throughput"] = await throughput(args, gateway, key, gen, sims)
    if paced_gen is not None:
        gateways = {"gateway": gateway, **({"gateway B": gateway_b} if gateway_b is not None else {})}
        out["paced"] = await paced(args, gateways, key, paced_gen, routers, floors)
    out["gateway_peak_rss_mib"] = h.hwm_mib(gateway.pid)
    print(f"\ngateway peak RSS (VmHWM): {out['gateway_peak_rss_mib']:.1f} MiB")
    return out


def main() -> None:
    args = parse_args()
    h.raise_nofile()
    with h.Stack("relay", keep=args.keep, gateway_nodelay=args.gateway_nodelay) as stack:
        stack.migrate()
        # Unpaced tokens, instant prefill: what is left is transport and relay.
        ctx, gen = h.start_sim_pair(
            stack, tokens_per_second=0, prefill_tokens_per_second=0
        )
        # Pool options go on every call: `register_worker` does not save them on the call that
        # creates the pool (it only saves an existing pool's changes), so the second call applies them.
        disagg = {"schedule_style": "context_first", "max_local_prefill_tokens": 0}
        agg = {"schedule_style": "context_first", "max_local_prefill_tokens": 1_000_000}
        stack.register_worker("bench", h.MODEL, "context", ctx.url, **disagg)
        stack.register_worker("bench", h.MODEL, "generation", gen.url, **disagg)
        stack.register_worker("bench-agg", AGG_MODEL, "context", ctx.url, **agg)
        stack.register_worker("bench-agg", AGG_MODEL, "generation", gen.url, **agg)
        pools = stack.pool_settings()
        print("pools:", pools)
        if pools.get("bench-agg", {}).get("max_local_prefill_tokens") != 1_000_000:
            raise RuntimeError(f"pool bench-agg was not configured for the aggregated path: {pools}")
        pools_expected = ["bench", "bench-agg"]
        paced_gen = None
        if args.part in ("paced", "all"):
            # A generation worker of its own, pacing every stream; the pool skips the context phase.
            paced_gen = stack.start_simworker("generation", tokens_per_second=1000 / args.ms_per_token, prefill_tokens_per_second=0)
            stack.register_worker("bench-paced", PACED_MODEL, "context", ctx.url, **agg)
            stack.register_worker("bench-paced", PACED_MODEL, "generation", paced_gen.url, **agg)
            pools_expected.append("bench-paced")
        key = stack.create_api_key("bench")
        gateway = stack.start_gateway({}, expect_pools=pools_expected, processes=args.gateway_processes,
                                      shared_socket=args.shared_socket)
        gateway_b = None
        if paced_gen is not None and (args.b_root or args.b_env or args.b_shared_socket):
            b_env = dict(item.split("=", 1) for item in args.b_env)
            gateway_b = stack.start_gateway(b_env, expect_pools=pools_expected, root=args.b_root,
                                            processes=args.gateway_processes, shared_socket=args.b_shared_socket)
        routers = {}
        if paced_gen is not None:
            for name in (n.strip() for n in args.routers.split(",") if n.strip()):
                routers[name] = stack.start_router(name, paced_gen.url)
        floors = {}
        if paced_gen is not None:
            for variant in (v.strip() for v in args.floors.split(",") if v.strip()):
                floors[f"floor {variant}"] = stack.start_floor(variant, paced_gen.url)
        with h.profiled([gateway.pid], h.result_name(args, "relay") + "-gateway", args.profile):
            result = asyncio.run(run(args, gateway, key, gen, [ctx, gen], paced_gen, gateway_b, routers, floors))
    h.write_result(h.result_name(args, "relay"), result)


if __name__ == "__main__":
    main()
