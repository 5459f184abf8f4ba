#!/usr/bin/env python
"""N concurrent streamed requests whose context phase is long: how fast each stream starts, how
long it stays silent, and what an idle open stream costs the gateway.

    .venv/bin/python bench/stream_start.py                     # 200 streams, 30 s context phase
    .venv/bin/python bench/stream_start.py --streams 1000 --context-delay 40
    .venv/bin/python bench/stream_start.py --streams 2000 --context-delay 35 --ping-interval 10
    .venv/bin/python bench/stream_start.py --quick             # smoke test, a few seconds

Every request is `[sim context_delay=S tokens=N]`, streamed, through one daphne process with the
gateway's default settings unless --start-wait / --ping-interval say otherwise. All requests are
written in the same instant on connections opened beforehand. Per stream the client records the
arrival of the status line and of every SSE frame (pings, message_start, …, message_stop); the
largest silent gap is the longest stretch without a byte-carrying frame from the status line to
the end of the response.

Targets: p99 time to status line ≤ start_wait + 50 ms (1,000 streams); every silent stream gets a
frame at least every ping_interval + 0.5 s (2,000 streams); gateway RSS at rest ≤ 150 MB; memory
per idle open stream ≤ 50 KiB.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

RSS_AT_REST_TARGET_MB = 150.0
PER_STREAM_TARGET_KIB = 50.0
STATUS_SLACK_S = 0.050
GAP_SLACK_S = 0.5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, help="concurrent streams (default 200; --quick 50)")
    parser.add_argument("--context-delay", type=float, help="seconds of the context phase (default 30; --quick 3)")
    parser.add_argument("--tokens", type=int, default=4, help="tokens each stream generates (default 4)")
    parser.add_argument("--ping-interval", type=float, help="MESSAGES_PING_INTERVAL_S (default 10; --quick 1)")
    parser.add_argument("--start-wait", type=float, help="MESSAGES_STREAM_START_WAIT_S (default 1; --quick 0.5)")
    parser.add_argument("--processes", type=int, default=1,
                        help="daphne processes on the same database, the connections split between them as a load "
                             "balancer would (default 1); memory and CPU figures are their sums")
    parser.add_argument("--ramp", type=float, default=0.0,
                        help="spread the requests' writes evenly over this many seconds (default 0: all in one instant)")
    parser.add_argument("--sample-interval", type=float, default=0.25, help="RSS sampling period, s")
    args = h.parse_args(
        parser,
        quick={"streams": 50, "context_delay": 3.0, "ping_interval": 1.0, "start_wait": 0.5},
        full={"streams": 200, "context_delay": 30.0, "ping_interval": 10.0, "start_wait": 1.0},
    )
    return args


async def open_connections(port: int, count: int, batch: int = 500) -> list[h.HttpConnection]:
    connections: list[h.HttpConnection] = []
    for start in range(0, count, batch):
        connections += await asyncio.gather(*(h.connect(port) for _ in range(start, min(count, start + batch))))
    return connections


async def write_requests(connections: list[h.HttpConnection], wires: list[bytes], ramp: float) -> list[asyncio.Future[h.Response]]:
    """One request per connection: all in the same instant, or the i-th at i·ramp/N seconds."""
    if ramp <= 0:
        return [conn.request(wire, frames=True) for conn, wire in zip(connections, wires, strict=True)]
    futures = []
    start = time.perf_counter()
    step = ramp / len(connections)
    for i, conn in enumerate(connections):
        delay = start + i * step - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        futures.append(conn.request(wires[i], frames=True))
    return futures


async def warm_up(port: int, key: str) -> None:
    """A few requests of each kind so lazily imported code and caches are loaded before 'at rest'."""
    conn = await h.connect(port)
    for directive in ("[sim tokens=4]", "[sim tokens=4]", "[sim context_delay=0.05 tokens=4]"):
        for stream in (True, False):
            resp = await conn.request(h.gateway_request(port, key, h.messages_body(directive, stream=stream)))
            if resp.status != 200:
                raise RuntimeError(f"warm-up request failed: {resp.status} {resp.error}")
    conn.close()


def analyse(resp: h.Response, sent_at: float) -> dict[str, Any]:
    frames = resp.frames or []
    names = [name.decode() for _, name in frames]
    out: dict[str, Any] = {
        "status": resp.status,
        "error": resp.error,
        "complete": resp.done_at is not None and resp.error is None,
        "pings": names.count("ping"),
        "ended_with": names[-1] if names else None,
        "frames": len(frames),
        "content_events": names.count("content_block_delta"),
    }
    if resp.status_at is None:
        return out
    out["status_s"] = resp.status_at - sent_at
    marks = [resp.status_at] + [t for t, _ in frames]
    end = resp.done_at if resp.done_at is not None else time.perf_counter()
    marks.append(end)
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    out["max_gap_s"] = max(gaps) if gaps else 0.0
    # Where the longest silence was: useful when a stream misses the ping target.
    if gaps:
        i = gaps.index(out["max_gap_s"])
        out["max_gap_at_s"] = marks[i] - sent_at
    out["first_frame_s"] = frames[0][0] - sent_at if frames else None
    out["message_start_s"] = next((t - sent_at for t, n in frames if n == b"message_start"), None)
    out["done_s"] = end - sent_at
    out["frame_times_s"] = [(round(t - sent_at, 4), n.decode()) for t, n in frames]
    return out


async def run(args: argparse.Namespace, stack: h.Stack, gateways: list[h.GatewayProc], key: str, sims: list[h.SimProc]) -> dict[str, Any]:
    pids = [g.pid for g in gateways]

    def rss_all() -> float:
        return sum(h.rss_mib(pid) for pid in pids)

    for gateway in gateways:
        await warm_up(gateway.port, key)
    quiet = h.wait_for_quiet(args.quiet_wait)
    await asyncio.sleep(1.0)
    rss_rest = rss_all()

    # Split as a load balancer would: stream i goes to process i mod N, written in that order.
    body = h.messages_body(f"[sim context_delay={args.context_delay:g} tokens={args.tokens}]", stream=True)
    per_gateway = [
        await open_connections(gateway.port, len(range(i, args.streams, len(gateways))))
        for i, gateway in enumerate(gateways)
    ]
    wire_of = [h.gateway_request(gateway.port, key, body) for gateway in gateways]
    connections = [per_gateway[i % len(gateways)][i // len(gateways)] for i in range(args.streams)]
    wires = [wire_of[i % len(gateways)] for i in range(args.streams)]
    await asyncio.sleep(0.2)
    rss_connected = rss_all()

    samples: list[tuple[float, float]] = []
    stop_sampling = asyncio.Event()

    async def sampler(t0: float) -> None:
        while not stop_sampling.is_set():
            samples.append((time.perf_counter() - t0, rss_all()))
            try:
                await asyncio.wait_for(stop_sampling.wait(), args.sample_interval)
            except TimeoutError:
                pass

    gateway_names = ["gateway"] if len(gateways) == 1 else [f"gateway{i}" for i in range(len(gateways))]
    meter = h.CpuMeter({**dict(zip(gateway_names, pids, strict=True)), **{s.name: s.pid for s in sims}}).start()
    t0 = time.perf_counter()
    sampling = asyncio.create_task(sampler(t0))
    futures = await write_requests(connections, wires, args.ramp)
    write_done = time.perf_counter() - t0
    timeout = args.context_delay + 60 + args.streams * 0.1
    await asyncio.wait(futures, timeout=timeout)
    cpu = meter.stop()
    if len(gateways) > 1:
        cpu["gateway"] = sum(cpu[name] for name in gateway_names)
        cpu["gateway:loop-thread"] = sum(cpu[f"{name}:loop-thread"] for name in gateway_names)
    stop_sampling.set()
    await sampling
    peak_rss = sum(h.hwm_mib(pid) for pid in pids)
    for conn in connections:
        conn.close()

    responses = [f.result() if f.done() else None for f in futures]
    per_stream = []
    for conn, resp in zip(connections, responses, strict=True):
        if resp is None:
            resp = conn._resp or h.Response()  # still open at the timeout: analyse what arrived
            resp.error = resp.error or "timed out"
        per_stream.append(analyse(resp, resp.sent_at or t0))

    # RSS with every stream open and idle: samples after the last status line (plus a moment for
    # the upstream context requests to be in flight) and before the context phase ends.
    status_times = [s["status_s"] for s in per_stream if "status_s" in s]
    # With a ramp the last stream starts `ramp` seconds after the first (samples count from the first).
    all_started = (max(status_times) if status_times else args.start_wait) + args.ramp
    window = [rss for t, rss in samples if all_started + 0.5 <= t <= args.context_delay - 0.5]
    if not window:  # a very short context phase: the samples between start and the first tokens
        window = [rss for t, rss in samples if all_started <= t <= args.context_delay] or [samples[-1][1]]
    window.sort()
    rss_open = window[len(window) // 2]
    per_stream_kib = (rss_open - rss_rest) * 1024 / args.streams

    ok = [s for s in per_stream if s["status"] == 200 and s["complete"] and s["ended_with"] == "message_stop"]
    status_dist = h.distribution(s["status_s"] for s in per_stream if "status_s" in s)
    gap_dist = h.distribution(s["max_gap_s"] for s in per_stream if "max_gap_s" in s)
    start_dist = h.distribution(s["message_start_s"] for s in per_stream if s.get("message_start_s") is not None)
    done_dist = h.distribution(s["done_s"] for s in per_stream if "done_s" in s)
    ping_dist = h.distribution(s["pings"] for s in per_stream)
    first_frame_dist = h.distribution(s["first_frame_s"] for s in per_stream if s.get("first_frame_s") is not None)

    status_target = args.start_wait + STATUS_SLACK_S
    gap_target = args.ping_interval + GAP_SLACK_S
    streams_over_gap = sum(1 for s in per_stream if s.get("max_gap_s", float("inf")) > gap_target)

    print(f"\n{args.streams} streams, context phase {args.context_delay:g} s, start wait {args.start_wait:g} s, "
          f"ping interval {args.ping_interval:g} s; all {args.streams} requests written in {write_done * 1000:.1f} ms"
          + (f" (ramp {args.ramp:g} s)" if args.ramp > 0 else "")
          + (f"; {len(gateways)} gateway processes, figures summed" if len(gateways) > 1 else ""))
    h.print_distributions(
        "per stream, seconds from the request's write",
        [
            ("time to status line", status_dist),
            ("time to first frame", first_frame_dist),
            ("time to message_start", start_dist),
            ("time to end (message_stop)", done_dist),
            ("largest silent gap", gap_dist),
        ],
        digits=3,
    )
    h.print_distributions("pings per stream", [("pings", ping_dist)], digits=1)
    h.print_table(
        "gateway process (daphne) and the others",
        ("", "value"),
        [
            ["streams ok (200, ended with message_stop)", f"{len(ok)} / {args.streams}"],
            ["gateway RSS at rest before the load, MiB", rss_rest],
            [f"gateway RSS with {args.streams} connections open (no request yet), MiB", rss_connected],
            [f"gateway RSS with {args.streams} streams open, idle in the context phase, MiB", rss_open],
            ["memory per idle open stream, KiB", per_stream_kib],
            ["gateway peak RSS (VmHWM), MiB" + (f", sum of {len(gateways)} processes" if len(gateways) > 1 else ""), peak_rss],
            ["gateway CPU during the load, s", cpu["gateway"]],
            ["  of which the event-loop thread, s", cpu["gateway:loop-thread"]],
            *[[f"{s.name} CPU during the load, s", cpu[s.name]] for s in sims],
            ["load generator CPU during the load, s", cpu["loadgen"]],
            ["wall time of the load, s", meter.wall],
        ],
    )
    print(f"({meter.machine_note()})")
    rss_rest_per_process = rss_rest / len(gateways)  # the target is per process
    checks = {
        "rss_at_rest": {"value_mb": rss_rest_per_process, "target_mb": RSS_AT_REST_TARGET_MB,
                        "ok": rss_rest_per_process <= RSS_AT_REST_TARGET_MB},
        "memory_per_idle_stream": {"value_kib": per_stream_kib, "target_kib": PER_STREAM_TARGET_KIB, "ok": per_stream_kib <= PER_STREAM_TARGET_KIB},
        "p99_time_to_status_line": {"value_s": status_dist.get("p99"), "target_s": status_target,
                                      "ok": bool(status_dist.get("n")) and status_dist["p99"] <= status_target},
        "largest_silent_gap": {"max_s": gap_dist.get("max"), "target_s": gap_target, "streams_over": streams_over_gap,
                                "ok": bool(gap_dist.get("n")) and streams_over_gap == 0},
        "all_streams_ok": {"ok_streams": len(ok), "streams": args.streams, "ok": len(ok) == args.streams},
    }
    h.print_table(
        "targets",
        ("", "measured", "target", ""),
        [
            ["RSS at rest (per process), MiB", rss_rest_per_process, f"<= {RSS_AT_REST_TARGET_MB:g}", h.verdict(checks["rss_at_rest"]["ok"])],
            ["memory per idle open stream, KiB", per_stream_kib, f"<= {PER_STREAM_TARGET_KIB:g}",
             h.verdict(checks["memory_per_idle_stream"]["ok"])],
            ["p99 time to status line, s", status_dist.get("p99", float("nan")), f"<= {status_target:.3f}",
             h.verdict(checks["p99_time_to_status_line"]["ok"])],
            ["largest silent gap (max over streams), s", gap_dist.get("max", float("nan")), f"<= {gap_target:g}",
             h.verdict(checks["largest_silent_gap"]["ok"])],
            ["streams ok", len(ok), args.streams, h.verdict(checks["all_streams_ok"]["ok"])],
        ],
        digits=3,
    )
    if streams_over_gap:
        worst = max((s for s in per_stream if "max_gap_s" in s), key=lambda s: s["max_gap_s"])
        print(f"\n{streams_over_gap} streams had a silent gap over {gap_target:g} s; the worst "
              f"({worst['max_gap_s']:.3f} s) began {worst.get('max_gap_at_s', 0):.3f} s after its request")
    errors = [s for s in per_stream if s not in ok]
    if errors:
        print(f"\n{len(errors)} streams did not end well; first: status {errors[0]['status']} "
              f"error {errors[0]['error']} last frame {errors[0]['ended_with']}")

    return {
        "config": {
            "streams": args.streams,
            "context_delay_s": args.context_delay,
            "tokens": args.tokens,
            "start_wait_s": args.start_wait,
            "ping_interval_s": args.ping_interval,
            "ramp_s": args.ramp,
            "processes": args.processes,
            "gateway_nodelay": args.gateway_nodelay,
        },
        "write_all_ms": write_done * 1000,
        "time_to_status_line_ms": h.in_ms(status_dist),
        "time_to_first_frame_ms": h.in_ms(first_frame_dist),
        "time_to_message_start_ms": h.in_ms(start_dist),
        "time_to_end_ms": h.in_ms(done_dist),
        "largest_silent_gap_ms": h.in_ms(gap_dist),
        "pings_per_stream": ping_dist,
        "gateway": {
            "rss_at_rest_mib": rss_rest,
            "rss_connections_open_mib": rss_connected,
            "rss_streams_open_mib": rss_open,
            "memory_per_idle_stream_kib": per_stream_kib,
            "peak_rss_mib": peak_rss,
            "cpu_s": cpu["gateway"],
        },
        "cpu_s": cpu,
        "wall_s": meter.wall,
        "machine": meter.machine_note(),
        "quiet": quiet,
        "rss_samples_mib": [(round(t, 3), round(r, 2)) for t, r in samples],
        "checks": checks,
        "streams_ok": len(ok),
        "streams_sample": per_stream[:3],
    }


def main() -> None:
    args = parse_args()
    h.raise_nofile()
    with h.Stack("stream-start", keep=args.keep, gateway_nodelay=args.gateway_nodelay) as stack:
        stack.migrate()
        # Unpaced tokens: the stream's end follows the context phase at once.
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=0, kv_timeout=120)
        stack.register_worker("bench", h.MODEL, "context", ctx.url, schedule_style="context_first")
        stack.register_worker("bench", h.MODEL, "generation", gen.url)
        key = stack.create_api_key("bench")
        gateways = [
            stack.start_gateway(
                {"MESSAGES_STREAM_START_WAIT_S": args.start_wait, "MESSAGES_PING_INTERVAL_S": args.ping_interval},
                expect_pools=["bench"],
            )
            for _ in range(args.processes)
        ]
        with h.profiled([g.pid for g in gateways], h.result_name(args, "stream_start") + "-gateway", args.profile):
            result = asyncio.run(run(args, stack, gateways, key, [ctx, gen]))
    h.write_result(h.result_name(args, "stream_start"), result)


if __name__ == "__main__":
    main()
