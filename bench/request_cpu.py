#!/usr/bin/env python
"""Gateway CPU per Claude Code request: the replayed request, one at a time, non-streamed and streamed.

    .venv/bin/python bench/request_cpu.py                        # 5 rounds × 200 requests per mode
    .venv/bin/python bench/request_cpu.py --b-root /tmp/base     # A/B: gateway B from another checkout
    .venv/bin/python bench/request_cpu.py --quick                # smoke test, a few seconds
    .venv/bin/python bench/request_cpu.py --request small        # a one-line prompt, context phase skipped
    .venv/bin/python bench/request_cpu.py --instructions --b-root /tmp/base   # instructions, not CPU time

The request is tests/fixtures/claude_code_request.json (83 KB, ~20k prompt tokens, 23 tools) with
`max_tokens` 4: what the gateway spends is per request (parse, validate, convert, estimate the
prompt, the context phase and its ~20k token ids, the generation request, the answer), not per
token. Sim workers unpaced (tokens and prefill instant), the pool disaggregated (context first,
`max_local_prefill_tokens` 0: every request takes the context phase). One keep-alive connection,
one request at a time: CPU per request = the gateway's CPU seconds (`/proc/<pid>/stat`, all
threads) over N requests / N, after a warm-up on that connection.

With `--b-root PATH` a second gateway ('B') runs from that checkout, in front of the same workers
and database; every round measures A then B then A... interleaved per mode, so both see the same
machine. Reported per gateway and mode: best and median over the rounds of CPU µs per request
(and its kernel part) and wall ms per request; with B, B − A of the medians.

With `--instructions` each gateway runs under valgrind's callgrind and the figure is the
instructions it executes per request (all its threads, not the kernel's part), counted only
while the measured requests run (bench/harness/instructions.py): the same whatever the machine's
other tenants do, so a difference of a per cent between two commits shows. Slow (the gateway runs
20-50 times slower): fewer requests per round by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

FIXTURE = h.PROJECT_ROOT / "tests" / "fixtures" / "claude_code_request.json"
MODES = ("nonstream", "stream")
FLOORS = ("stock", "answer", "relay", "relay-aiohttp")  # bench/framework_floor.py's


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, help="N requests measured per round, gateway and mode (default 200; --quick 20)")
    parser.add_argument("--warmup", type=int, help="requests before the first round, per gateway and mode (default 20; --quick 5)")
    parser.add_argument("--rounds", type=int, help="rounds; best and median over them (default 5; --quick 1)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: nonstream,stream (default both)")
    parser.add_argument("--routing", default="round_robin", choices=["round_robin", "least_loaded", "session_affinity", "cache_aware"],
                        help="the pool's routing policy (cache_aware: the prefix index's work is in the figures too)")
    parser.add_argument("--request", default="claude_code", choices=["claude_code", "small"],
                        help="claude_code: the replayed fixture, context phase taken (default); small: a one-line "
                        "prompt, context phase skipped")
    parser.add_argument("--token-ids-b64", action="store_true",
                        help="claude_code: the context endpoint gets the option prompt_token_ids_b64 (the prompt's ids "
                        "relayed as one base64 int32 string, TensorRT-LLM's gen_tokids_ctxbytes) instead of a JSON array")
    parser.add_argument("--b-root", type=Path,
                        help="A/B: a second gateway ('B') run from this checkout of the project (another commit), in front "
                        "of the same workers and database, measured right after gateway A in every round")
    parser.add_argument("--b-env", action="append", default=[], metavar="KEY=VALUE",
                        help="A/B: a setting of gateway B (repeatable); with no --b-root, B runs from this checkout")
    parser.add_argument("--instructions", action="store_true",
                        help="count the instructions each gateway executes per request (valgrind's callgrind) instead of "
                        "timing its CPU: deterministic, slow (default 3 rounds × 100 requests)")
    parser.add_argument("--database-url",
                        help="the gateways' database (default: a new SQLite file; a PostgreSQL one is created when missing "
                        "and must hold no pool named bench: use a new name per run). On SQLite the gateway's own "
                        "process does the database's work of writing its rows; on PostgreSQL the server does")
    parser.add_argument("--floors", action="store_true",
                        help="small: also measure bench/framework_floor.py's floors in the same rounds, daphne and "
                        "Channels with nothing of the gateway's: 'floor stock' (Channels' stock consumer answers from "
                        "constants), 'floor answer' (the same through the gateway's shortcuts), 'floor relay' (that, "
                        "relaying the generation worker's stream on a lean asyncio protocol) and 'floor relay-aiohttp' (the "
                        "same over aiohttp's client)")
    h.add_common_arguments(parser)
    args = parser.parse_args()
    if args.floors and args.request != "small":
        parser.error("--floors measures the small request (--request small)")
    if args.instructions:
        if not h.callgrind_available():
            parser.error("--instructions needs valgrind (apt-get install valgrind)")
        if args.quiet_wait is None:
            args.quiet_wait = 0.0  # counts do not depend on what else runs
        h.resolve(args, {"requests": 10, "warmup": 5, "rounds": 1}, {"requests": 100, "warmup": 10, "rounds": 3})
    else:
        h.resolve(args, {"requests": 20, "warmup": 5, "rounds": 1}, {"requests": 200, "warmup": 20, "rounds": 5})
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes: a comma-separated subset of {','.join(MODES)}")
    return args


def request_body(stream: bool, kind: str = "claude_code") -> bytes:
    if kind == "small":
        return h.messages_body("[sim tokens=4]", stream=stream, max_tokens=4)
    body = json.loads(FIXTURE.read_text())["body"]
    return json.dumps({**body, "model": h.MODEL, "max_tokens": 4, "stream": stream}, separators=(",", ":")).encode()


def check_answer(response: h.Response, stream: bool) -> None:
    """A figure is only worth something if the request did what it should: a 200 with the whole
    answer (a message, or a stream to its message_stop)."""
    if response.error or response.status != 200 or response.done_at is None or response.body is None:
        raise RuntimeError(f"request failed: status {response.status}, error {response.error}")
    if stream:
        if b"event: message_stop" not in response.body:
            raise RuntimeError("a streamed answer ended without message_stop")
    elif json.loads(bytes(response.body)).get("type") != "message":
        raise RuntimeError(f"not a message: {bytes(response.body[:300])!r}")


async def drive(conn: h.KeepAlive, wire: bytes, stream: bool, n: int) -> None:
    for _ in range(n):
        check_answer(await conn.request(wire, keep_body=True), stream)


def measure(loop: asyncio.AbstractEventLoop, gateway: h.GatewayProc, conn: h.KeepAlive, wire: bytes, stream: bool, n: int) -> dict[str, float]:
    """CPU and wall per request over n requests on the connection."""
    faults0, main0 = h.proc_minor_faults(gateway.pid), h.thread_cpu_seconds(gateway.pid)
    cpu0, sys0, t0 = h.proc_cpu_seconds(gateway.pid), h.proc_sys_cpu_seconds(gateway.pid), time.perf_counter()
    loop.run_until_complete(drive(conn, wire, stream, n))
    cpu1, sys1, t1 = h.proc_cpu_seconds(gateway.pid), h.proc_sys_cpu_seconds(gateway.pid), time.perf_counter()
    faults, main1 = h.proc_minor_faults(gateway.pid) - faults0, h.thread_cpu_seconds(gateway.pid)
    return {
        "cpu_us": (cpu1 - cpu0) / n * 1e6,
        "loop_cpu_us": (main1 - main0) / n * 1e6,
        "kernel_us": (sys1 - sys0) / n * 1e6,
        "wall_ms": (t1 - t0) / n * 1e3,
        "minor_faults": faults / n,
    }


# Under valgrind a request takes 20-50 times longer: settings that would send it down another path
# because it is slow (a stream started before its worker answered, pings, requests shed while the
# loop lags) are moved out of the way, so the instructions counted are those of the usual path.
# A fixed hash seed: with a random one, dicts and sets lay out differently in every process (two
# gateways of the same code differed by 6 % in one run; ≤ 2 % with the seed fixed).
# The background work that runs on a clock (registry refresh, health probes, heartbeat) is spread
# over 20-50 times as many wall seconds per request as without valgrind: made rare, so the count
# is the requests' own.
INSTRUCTION_SETTINGS = {
    "MESSAGES_STREAM_START_WAIT_S": "60", "MESSAGES_PING_INTERVAL_S": "600", "GATEWAY_SHED_LOOP_LAG_S": "0", "PYTHONHASHSEED": "0",
    "REGISTRY_REFRESH_INTERVAL_S": "600", "HEALTH_CHECK_INTERVAL_S": "600", "GATEWAY_HEARTBEAT_INTERVAL_S": "600",
}
# valgrind translates the whole gateway (Django, the app) before it is ready.
INSTRUCTION_START_S = 900.0


def measure_instructions(
    loop: asyncio.AbstractEventLoop, counter: h.CallgrindCounter, conn: h.KeepAlive, wire: bytes, stream: bool, n: int
) -> dict[str, Any]:
    """Instructions the gateway executed per request over n requests: all threads, and the main
    thread's (the event loop's) part."""
    counter.start()
    loop.run_until_complete(drive(conn, wire, stream, n))
    threads = counter.stop()
    return {"instructions": sum(threads) / n, "loop_instructions": threads[0] / n, "threads": [t / n for t in threads]}


def summarize_instructions(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "min_instructions": min(s["instructions"] for s in samples),
        "median_instructions": statistics.median(s["instructions"] for s in samples),
        "median_loop_instructions": statistics.median(s["loop_instructions"] for s in samples),
        "rounds": samples,
    }


def summarize(samples: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "best_cpu_us": min(s["cpu_us"] for s in samples),
        "median_cpu_us": statistics.median(s["cpu_us"] for s in samples),
        "median_loop_cpu_us": statistics.median(s["loop_cpu_us"] for s in samples),
        "median_kernel_us": statistics.median(s["kernel_us"] for s in samples),
        "median_wall_ms": statistics.median(s["wall_ms"] for s in samples),
        "median_minor_faults": statistics.median(s["minor_faults"] for s in samples),
        "rounds": samples,
    }


def main() -> None:
    args = parse_args()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    if args.database_url and args.database_url.startswith("postgres"):
        from nonstream_rps import ensure_postgres_database

        ensure_postgres_database(args.database_url)
    with h.Stack("request_cpu", database_url=args.database_url, keep=args.keep, gateway_nodelay=args.gateway_nodelay) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=0, prefill_tokens_per_second=0)
        # Options on both calls: register_worker saves them only on a call for an existing pool.
        # The small request skips the context phase, as a paced relay stream does.
        local_prefill = 1_000_000 if args.request == "small" else 0
        disagg = {"schedule_style": "context_first", "max_local_prefill_tokens": local_prefill, "routing": args.routing}
        context_options = {"option": "prompt_token_ids_b64=true"} if args.token_ids_b64 else {}
        stack.register_worker("bench", h.MODEL, "context", ctx.url, **disagg, **context_options)
        stack.register_worker("bench", h.MODEL, "generation", gen.url, **disagg)
        key = stack.create_api_key("bench")
        under: dict[str, Any] = {}
        gateway_env: dict[str, str] = {}
        if args.instructions:
            under = {"wrapper": h.callgrind_command(stack.tmp), "ready_timeout": INSTRUCTION_START_S}
            gateway_env = dict(INSTRUCTION_SETTINGS)
        gateways = {"A": stack.start_gateway(gateway_env, expect_pools={"bench"}, **under)}
        if args.b_root or args.b_env:
            b_env = gateway_env | dict(item.split("=", 1) for item in args.b_env)
            gateways["B"] = stack.start_gateway(b_env, expect_pools={"bench"}, root=args.b_root, **under)
        if args.floors:
            for tier in FLOORS:
                floor_env = gateway_env | {"FRAMEWORK_FLOOR": tier, "FLOOR_UPSTREAM": gen.url}
                quiet_access = () if tier == "stock" else ("-v", "0")  # the lean floors write no access line
                gateways[f"floor {tier}"] = stack.start_gateway(floor_env, application="bench.framework_floor:application",
                                                                 daphne_args=quiet_access, **under)
        counters = {name: h.CallgrindCounter(gw.pid) for name, gw in gateways.items()} if args.instructions else {}
        conns = {(name, mode): h.KeepAlive(gw.port) for name, gw in gateways.items() for mode in args.modes}
        wires = {(name, mode): h.gateway_request(gw.port, key, request_body(mode == "stream", args.request))
                 for name, gw in gateways.items() for mode in args.modes}
        for (name, mode), conn in conns.items():
            loop.run_until_complete(drive(conn, wires[name, mode], mode == "stream", args.warmup))
        quiet = h.wait_for_quiet(args.quiet_wait)
        samples: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in conns}
        meter = h.CpuMeter({f"gateway {n}": gw.pid for n, gw in gateways.items()} | {"context": ctx.pid, "generation": gen.pid}).start()
        with h.profiled([gw.pid for gw in gateways.values()], h.result_name(args, "request_cpu") + "-gateway", args.profile):
            for _ in range(args.rounds):
                for mode in args.modes:
                    for name, gateway in gateways.items():
                        stream = mode == "stream"
                        if args.instructions:
                            sample = measure_instructions(loop, counters[name], conns[name, mode], wires[name, mode], stream, args.requests)
                        else:
                            sample = measure(loop, gateway, conns[name, mode], wires[name, mode], stream, args.requests)
                        samples[name, mode].append(sample)
        meter.stop()
        for conn in conns.values():
            conn.close()
    loop.close()

    what = "Claude Code request" if args.request == "claude_code" else "small request"
    if args.instructions:
        report_instructions(args, what, {f"{name} {mode}": summarize_instructions(s) for (name, mode), s in samples.items()},
                            "B" in gateways)
        return
    results = {f"{name} {mode}": summarize(s) for (name, mode), s in samples.items()}
    rows = [[label, r["best_cpu_us"], r["median_cpu_us"], r["median_loop_cpu_us"], r["median_kernel_us"], r["median_wall_ms"],
             r["median_minor_faults"]] for label, r in results.items()]
    h.print_table(f"gateway CPU per {what} ({args.rounds} rounds × {args.requests} requests; best and median of the rounds)",
                  ("gateway mode", "best CPU µs", "median CPU µs", "of which loop", "kernel µs", "wall ms", "faults"), rows, digits=0)
    deltas = {}
    if "B" in gateways:
        for mode in args.modes:
            a, b = results[f"A {mode}"]["median_cpu_us"], results[f"B {mode}"]["median_cpu_us"]
            deltas[mode] = {"b_minus_a_us": b - a, "b_over_a": b / a if a else float("nan")}
        h.print_table("B − A (medians)", ("mode", "B − A µs", "B / A"),
                      [[m, d["b_minus_a_us"], d["b_over_a"]] for m, d in deltas.items()], digits=2)
    print(meter.machine_note())
    print(quiet)
    h.write_result(h.result_name(args, "request_cpu"), {
        "config": {"requests": args.requests, "warmup": args.warmup, "rounds": args.rounds, "modes": args.modes,
                   "b_root": str(args.b_root) if args.b_root else None, "b_env": args.b_env,
                   "request": args.request, "floors": args.floors, "database": database_kind(args),
                   "token_ids_b64": args.token_ids_b64, "fixture": str(FIXTURE.relative_to(h.PROJECT_ROOT))},
        "results": results, "b_minus_a": deltas, "cpu_seconds": meter.used, "machine_note": meter.machine_note(), "quiet": quiet,
    })


def database_kind(args: argparse.Namespace) -> str:
    """The database's kind, never its URL (which may hold a password)."""
    return args.database_url.split(":", 1)[0] if args.database_url else "sqlite"


def report_instructions(args: argparse.Namespace, what: str, results: dict[str, dict[str, Any]], ab: bool) -> None:
    rows = [[label, r["min_instructions"] / 1e6, r["median_instructions"] / 1e6, r["median_loop_instructions"] / 1e6]
            for label, r in results.items()]
    h.print_table(f"gateway instructions per {what} (callgrind, all threads; {args.rounds} rounds × {args.requests} requests)",
                  ("gateway mode", "min M instr", "median M instr", "of which loop thread"), rows, digits=3)
    deltas = {}
    if ab:
        for mode in args.modes:
            a, b = results[f"A {mode}"]["median_instructions"], results[f"B {mode}"]["median_instructions"]
            deltas[mode] = {"b_minus_a": b - a, "b_over_a": b / a if a else float("nan")}
        h.print_table("B − A (medians)", ("mode", "B − A M instr", "B / A"),
                      [[m, d["b_minus_a"] / 1e6, d["b_over_a"]] for m, d in deltas.items()], digits=3)
    h.write_result(h.result_name(args, "request_instructions"), {
        "config": {"requests": args.requests, "warmup": args.warmup, "rounds": args.rounds, "modes": args.modes,
                   "b_root": str(args.b_root) if args.b_root else None, "b_env": args.b_env, "request": args.request, "floors": args.floors,
                   "database": database_kind(args),
                   "token_ids_b64": args.token_ids_b64, "settings": INSTRUCTION_SETTINGS},
        "results": results, "b_minus_a": deltas,
    })


if __name__ == "__main__":
    main()
