#!/usr/bin/env python
"""1,000 streams arriving together from one key at a pool with capacity 2: when each stream's
status line leaves, what is shed or refused, and how `/health` answers meanwhile (issue 42 part 4).

    .venv/bin/python bench/burst.py                      # 1,000 streams
    .venv/bin/python bench/burst.py --streams 300 --b-root /work/main   # A/B, same run
    .venv/bin/python bench/burst.py --quick              # smoke test (100 streams)

One daphne process (the gateway's default settings), a context and a generation sim worker as
processes; the generation endpoint's capacity is 2, so all but two of the streams wait in the
admission queue (with their status line and pings). Every request is `[sim tokens=N]`, streamed,
from one key, written in the same instant on connections opened beforehand. Per stream the client
records the status line's arrival (from its write), its status, and the error event a stream ended
with. A separate process probes `GET /health` every --probe-interval s on its own keep-alive
connection from before the burst until its last stream ended, and reports each answer's latency.

Targets: status line p99 <= MESSAGES_STREAM_START_WAIT_S + 0.1 s; /health p99 <= 50 ms; no 529 or
503 (before or after the status line) for a request the gateway accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

STATUS_SLACK_S = 0.1
HEALTH_P99_TARGET_S = 0.050


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, help="streams arriving together (default 1000; --quick 100)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens each stream generates (default 8)")
    parser.add_argument("--tokens-per-second", type=float, default=0, help="the sims' decode pace (default 0: unpaced)")
    parser.add_argument("--capacity", type=int, default=2, help="the generation endpoint's capacity (default 2)")
    parser.add_argument("--start-wait", type=float, default=1.0, help="MESSAGES_STREAM_START_WAIT_S (default 1)")
    parser.add_argument("--probe-interval", type=float, default=0.01, help="seconds between /health probes (default 0.01)")
    parser.add_argument("--repeat", type=int, default=1, help="bursts per gateway (default 1)")
    parser.add_argument("--b-root", type=Path, help="another checkout: its gateway takes a burst after each of this one's")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE", help="a gateway setting (repeatable)")
    parser.add_argument("--probe-path", default="/health", help="the path the side prober GETs (default /health)")
    parser.add_argument("--probe", nargs=3, metavar=("PORT", "INTERVAL", "PATH"), help=argparse.SUPPRESS)
    return h.parse_args(parser, quick={"streams": 100}, full={"streams": 1000})


# --- the /health prober (its own process: the client's loop must not delay its reads) -------------


def probe_main(port: int, interval: float, path: str) -> None:
    """GET `path` until stdin closes; print one JSON list of [start offset, latency, status]."""
    import threading

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    wire = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples: list[tuple[float, float, int]] = []
    t0 = time.perf_counter()
    while not stop.is_set():
        started = time.perf_counter()
        sock.sendall(wire)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(rest) < length:
            rest += sock.recv(65536)
        samples.append((started - t0, time.perf_counter() - started, int(head[9:12])))
        time.sleep(max(0.0, interval - (time.perf_counter() - started)))
    print(json.dumps(samples))


class HealthProber:
    def __init__(self, port: int, interval: float, path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--probe", str(port), str(interval), path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.started = time.perf_counter()

    def stop(self) -> list[tuple[float, float, int]]:
        out, _ = self.proc.communicate(b"", timeout=60)
        return [(self.started + t, lat, status) for t, lat, status in json.loads(out)]


# --- the burst -----------------------------------------------------------------------------------


def error_of(body: bytes | bytearray | None) -> str | None:
    """The error type and message a response carried (a JSON error, or a stream's error event)."""
    if not body:
        return None
    text = bytes(body)
    i = text.find(b'"type":"error"')
    if i < 0:
        return None
    start = text.rfind(b"{", 0, i)
    end = text.find(b"\n", i)
    try:
        payload = json.loads(text[start : end if end >= 0 else len(text)])
    except ValueError:
        return "unparsed error"
    return f"{payload['error']['type']}: {payload['error']['message'][:80]}"


async def burst(gateway: h.GatewayProc, key: str, args: argparse.Namespace) -> dict[str, Any]:
    port = gateway.port
    warm = await h.connect(port)
    for _ in range(3):
        resp = await warm.request(h.gateway_request(port, key, h.messages_body("[sim tokens=2]", stream=True)), keep_body=True)
        if resp.status != 200:
            raise RuntimeError(f"warm-up failed: {resp.status} {error_of(resp.body)}")
    warm.close()
    body = h.messages_body(f"[sim tokens={args.tokens}]", stream=True)
    wire = h.gateway_request(port, key, body)
    connections: list[h.HttpConnection] = []
    for start in range(0, args.streams, 250):
        connections += await asyncio.gather(*(h.connect(port) for _ in range(start, min(args.streams, start + 250))))
    await asyncio.sleep(0.5)
    prober = HealthProber(port, args.probe_interval, args.probe_path)
    await asyncio.sleep(0.5)  # the prober's quiet figures first
    meter = h.CpuMeter({"gateway": gateway.pid}).start()
    t0 = time.perf_counter()
    futures = [conn.request(wire, keep_body=True) for conn in connections]
    await asyncio.wait(futures, timeout=120 + args.streams * 0.05)
    cpu = meter.stop()
    await asyncio.sleep(0.3)
    probes = prober.stop()
    for conn in connections:
        conn.close()
    responses = [f.result() if f.done() else None for f in futures]
    status_s = [r.status_at - r.sent_at for r in responses if r is not None and r.status_at is not None]
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for r in responses:
        if r is None:
            statuses["timed out"] += 1
            continue
        statuses[str(r.status)] += 1
        error = error_of(r.body)
        if error:
            errors[f"{r.status} {error}"] += 1
    # A probe that was under way when the burst was written counts in the burst.
    during = [lat for at, lat, _ in probes if at + lat >= t0]
    before = [lat for at, lat, _ in probes if at + lat < t0]
    end = max((r.done_at for r in responses if r is not None and r.done_at), default=t0)
    return {
        "status_line_s": h.distribution(status_s),
        "late_status_lines": sum(1 for s in status_s if s > args.start_wait + STATUS_SLACK_S),
        "statuses": dict(statuses),
        "errors": dict(errors),
        "health_before_s": h.distribution(before),
        "health_during_s": h.distribution(during),
        "health_non_200": sum(1 for _, _, status in probes if status != 200),
        "health_worst_at_s": max(((lat, at - t0) for at, lat, _ in probes if at + lat >= t0), default=(0, 0))[1],
        "health_over_50ms": sum(1 for at, lat, _ in probes if at + lat >= t0 and lat > HEALTH_P99_TARGET_S),
        "burst_wall_s": end - t0,
        "gateway_cpu_s": cpu["gateway"],
        "machine": meter.machine_note(),
    }


def report(label: str, result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n== {label}: {args.streams} streams, capacity {args.capacity}, start wait {args.start_wait:g} s; "
          f"burst over in {result['burst_wall_s']:.2f} s, gateway CPU {result['gateway_cpu_s']:.2f} s ({result['machine']})")
    h.print_distributions(
        "seconds",
        [("status line (from the write)", result["status_line_s"]),
         ("/health before the burst", result["health_before_s"]),
         ("/health during the burst", result["health_during_s"])],
        digits=3,
    )
    print(f"status lines later than {args.start_wait + STATUS_SLACK_S:g} s: {result['late_status_lines']}")
    print(f"statuses: {result['statuses']}; /health non-200: {result['health_non_200']}; "
          f"/health over 50 ms during the burst: {result['health_over_50ms']}, the worst sent at {result['health_worst_at_s']:+.2f} s")
    for error, count in sorted(result["errors"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d} × {error}")


def main() -> None:
    args = parse_args()
    if args.probe:
        probe_main(int(args.probe[0]), float(args.probe[1]), args.probe[2])
        return
    h.raise_nofile()
    settings: dict[str, Any] = {"MESSAGES_STREAM_START_WAIT_S": args.start_wait}
    for item in args.setting:
        name, _, value = item.partition("=")
        settings[name] = value
    results: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    with h.Stack("burst", keep=args.keep, gateway_nodelay=args.gateway_nodelay) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=args.tokens_per_second, kv_timeout=300)
        stack.register_worker("bench", h.MODEL, "context", ctx.url, schedule_style="context_first")
        stack.register_worker("bench", h.MODEL, "generation", gen.url, capacity=args.capacity)
        key = stack.create_api_key("bench")
        gateways = {"A": stack.start_gateway(settings, expect_pools=["bench"])}
        if args.b_root:
            gateways["B"] = stack.start_gateway(settings, expect_pools=["bench"], root=args.b_root)
        h.wait_for_quiet(args.quiet_wait)
        with h.profiled([gateways["A"].pid], h.result_name(args, "burst") + "-gateway", args.profile):
            for i in range(args.repeat):
                for label, gateway in gateways.items():
                    result = asyncio.run(burst(gateway, key, args))
                    report(f"{label} #{i + 1}", result, args)
                    results[label].append(result)
                    time.sleep(2.0)
    h.write_result(h.result_name(args, "burst"), {
        "config": {"streams": args.streams, "tokens": args.tokens, "capacity": args.capacity,
                   "start_wait_s": args.start_wait, "settings": settings, "b_root": str(args.b_root or "")},
        "results": results,
    })


if __name__ == "__main__":
    main()
