#!/usr/bin/env python
"""The two worker transports compared: `lean` (workers/transport.py) and `aiohttp`
(httpx-aiohttp, workers/aiohttp_transport.py), gateway CPU per request and per relayed event.

    .venv/bin/python bench/transport.py                    # 5 repetitions (~3 min)
    .venv/bin/python bench/transport.py --repetitions 9
    .venv/bin/python bench/transport.py --quick            # smoke test

Two daphne processes on one database, one per `WORKER_TRANSPORT`, in front of the same sim
workers. Every repetition runs each phase once on each gateway, in a shuffled order, so both
see the same machine (the 2 cores are shared with other sessions: the spread across repetitions
says how noisy the figures are):

    non-streamed     C keep-alive connections send `stream: false` requests (`[sim tokens=4]`,
                     unpaced sims) until N are done: requests/s, gateway CPU µs per request, and
                     the two sims' CPU µs per request (the generation sim pulls each KV handoff
                     from the context sim with stock httpx)
    relay, unpaced   K streams × M tokens from unpaced sims (tokens arrive as fast as they can,
                     several per read): gateway CPU µs per relayed content event
    relay, paced     P streams × T tokens from sims pacing at `--paced-tps` tokens/s (one token
                     per read, as from a real engine): gateway CPU µs per relayed content event

The decision rule (issue 10): keep the lean transport only if it is at least 20 % cheaper per
request or per event. Printed: per phase and transport the distribution over repetitions, the
ratio of medians, and the verdict; written to bench/results/transport.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as h

KINDS = ("lean", "aiohttp")
PACED_MODEL = "sim-model-paced"
GATEWAY_CONTENT = b"event: content_block_delta"
KEEP_LEAN_IF_CHEAPER_BY = 0.20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, help="rounds of every phase on both gateways (default 5; --quick 1)")
    parser.add_argument("--concurrency", type=int, help="non-streamed: C connections (default 32; --quick 8)")
    parser.add_argument("--requests", type=int, help="non-streamed: N requests per run (default 2000; --quick 200)")
    parser.add_argument("--streams", type=int, help="unpaced relay: K streams (default 32; --quick 8)")
    parser.add_argument("--tokens", type=int, help="unpaced relay: M tokens per stream (default 2000; --quick 300)")
    parser.add_argument("--paced-streams", type=int, help="paced relay: P streams (default 50; --quick 10)")
    parser.add_argument("--paced-tokens", type=int, help="paced relay: T tokens per stream (default 150; --quick 30)")
    parser.add_argument("--paced-tps", type=float, default=50.0, help="paced sims' tokens/s (default 50: 20 ms a token)")
    h.add_common_arguments(parser)
    args = parser.parse_args()
    h.resolve(
        args,
        quick={"repetitions": 1, "concurrency": 8, "requests": 200, "streams": 8, "tokens": 300, "paced_streams": 10, "paced_tokens": 30},
        full={"repetitions": 5, "concurrency": 32, "requests": 2000, "streams": 32, "tokens": 2000, "paced_streams": 50, "paced_tokens": 150},
    )
    return args


async def nonstreamed(port: int, key: str, concurrency: int, total: int) -> dict[str, Any]:
    """C connections sending non-streamed requests until `total` are done."""
    wire = h.gateway_request(port, key, h.messages_body("[sim tokens=4]", stream=False))
    left = [total]
    done = [0]
    failures = [0]

    async def one_connection() -> None:
        conn = h.KeepAlive(port)
        try:
            while left[0] > 0:
                left[0] -= 1
                resp = await conn.request(wire)
                if resp.status == 200 and not resp.error and resp.done_at is not None:
                    done[0] += 1
                else:
                    failures[0] += 1
        finally:
            conn.close()

    await asyncio.gather(*(one_connection() for _ in range(concurrency)))
    return {"units": done[0], "failures": failures[0]}


async def streamed(port: int, key: str, model: str, streams: int, tokens: int) -> dict[str, Any]:
    """K concurrent streams of M tokens each; counts the content events the client received."""
    wire = h.gateway_request(port, key, h.messages_body(f"[sim tokens={tokens}]", stream=True, model=model))
    events = [0]
    failures = [0]

    async def one_stream() -> None:
        conn = h.KeepAlive(port)
        try:
            resp = await conn.request(wire, count=GATEWAY_CONTENT)
            events[0] += resp.count
            if resp.status != 200 or resp.error or resp.count != tokens:
                failures[0] += 1
        finally:
            conn.close()

    await asyncio.gather(*(one_stream() for _ in range(streams)))
    return {"units": events[0], "failures": failures[0]}


async def measure(phase: str, args: argparse.Namespace, gateway: h.GatewayProc, key: str, pids: dict[str, int]) -> dict[str, Any]:
    meter = h.CpuMeter({"gateway": gateway.pid, **pids}).start()
    if phase == "nonstreamed":
        out = await nonstreamed(gateway.port, key, args.concurrency, args.requests)
    elif phase == "relay-unpaced":
        out = await streamed(gateway.port, key, h.MODEL, args.streams, args.tokens)
    else:
        out = await streamed(gateway.port, key, PACED_MODEL, args.paced_streams, args.paced_tokens)
    cpu = meter.stop()
    units = out["units"] or 1
    result = {
        **out,
        "wall_s": meter.wall,
        "per_s": out["units"] / meter.wall,
        "gateway_cpu_us": cpu["gateway"] / units * 1e6,
        "gateway_loop_thread_cpu_us": cpu["gateway:loop-thread"] / units * 1e6,
        "others_cores": cpu["others"] / meter.wall,
        "machine": meter.machine_note(),
    }
    if phase == "nonstreamed":
        result["sims_cpu_us"] = (cpu["sim-context"] + cpu["sim-generation"]) / units * 1e6
        result["sim_generation_cpu_us"] = cpu["sim-generation"] / units * 1e6
        result["sim_context_cpu_us"] = cpu["sim-context"] / units * 1e6
    return result


PHASES = ("nonstreamed", "relay-unpaced", "relay-paced")
UNIT = {"nonstreamed": "request", "relay-unpaced": "event", "relay-paced": "event"}


async def run(args: argparse.Namespace, gateways: dict[str, h.GatewayProc], key: str, sims: dict[str, int]) -> dict[str, Any]:
    quiet = h.wait_for_quiet(args.quiet_wait)
    print("quiet:", quiet)
    # Warm-up: code paths and each gateway's worker connection pools.
    for kind, gateway in gateways.items():
        await nonstreamed(gateway.port, key, args.concurrency, max(100, args.concurrency * 4))
        await streamed(gateway.port, key, h.MODEL, args.streams, 50)
        await streamed(gateway.port, key, PACED_MODEL, args.paced_streams, 3)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {k: [] for k in KINDS} for p in PHASES}
    rng = random.Random(10)
    for repetition in range(args.repetitions):
        for phase in PHASES:
            order = list(KINDS)
            rng.shuffle(order)
            for kind in order:
                r = await measure(phase, args, gateways[kind], key, sims)
                runs[phase][kind].append(r)
                extra = f"  sims {r['sims_cpu_us']:.0f} µs/request" if "sims_cpu_us" in r else ""
                print(
                    f"rep {repetition + 1} {phase:14s} {kind:8s} {r['per_s']:9.0f} {UNIT[phase]}s/s  "
                    f"gateway {r['gateway_cpu_us']:7.1f} µs/{UNIT[phase]}  failures {r['failures']}  "
                    f"others {r['others_cores']:.2f} cores{extra}",
                    flush=True,
                )
                await asyncio.sleep(0.2)
    return summarize(runs)


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    rows = []
    for phase in PHASES:
        summary[phase] = {}
        for kind in KINDS:
            rs = runs[phase][kind]
            summary[phase][kind] = {
                "gateway_cpu_us": h.distribution(r["gateway_cpu_us"] for r in rs),
                "gateway_loop_thread_cpu_us": h.distribution(r["gateway_loop_thread_cpu_us"] for r in rs),
                "per_s": h.distribution(r["per_s"] for r in rs),
                "failures": sum(r["failures"] for r in rs),
                "others_cores": h.distribution(r["others_cores"] for r in rs),
                "runs": rs,
            }
            if phase == "nonstreamed":
                summary[phase][kind]["sims_cpu_us"] = h.distribution(r["sims_cpu_us"] for r in rs)
            d = summary[phase][kind]["gateway_cpu_us"]
            t = summary[phase][kind]["per_s"]
            rows.append([f"{phase} / {kind}", d["n"], d["min"], d["p50"], d["max"], t["p50"], summary[phase][kind]["failures"]])
    h.print_table(
        "gateway CPU µs per request (non-streamed) or per relayed content event, over repetitions",
        ("phase / transport", "n", "min", "median", "max", "median rate/s", "failures"),
        rows,
        digits=1,
    )
    decision_rows = []
    cheaper_by: dict[str, float] = {}
    for phase in PHASES:
        lean = summary[phase]["lean"]["gateway_cpu_us"]["p50"]
        lib = summary[phase]["aiohttp"]["gateway_cpu_us"]["p50"]
        cheaper_by[phase] = 1.0 - lean / lib  # > 0: lean is cheaper
        # The same within each repetition (the two runs were back to back): machine drift between
        # repetitions cancels out, so this spread is the honest one.
        paired = h.distribution(
            100 * (1.0 - a["gateway_cpu_us"] / b["gateway_cpu_us"])
            for a, b in zip(runs[phase]["lean"], runs[phase]["aiohttp"])
        )
        summary[phase]["lean_cheaper_by_per_repetition_pct"] = paired
        decision_rows.append([phase, lean, lib, f"{100 * cheaper_by[phase]:+.1f} %", paired["min"], paired["p50"], paired["max"]])
    h.print_table(
        "medians: how much cheaper the lean transport is (the rule: keep it if ≥ 20 % on any)",
        ("phase", "lean µs", "aiohttp µs", "lean cheaper by", "per rep: min %", "median %", "max %"),
        decision_rows,
        digits=1,
    )
    keep = any(v >= KEEP_LEAN_IF_CHEAPER_BY for v in cheaper_by.values())
    print(f"\ndecision by the rule: {'keep the lean transport' if keep else 'use the library (aiohttp) transport'}")
    sims = {kind: summary["nonstreamed"][kind]["sims_cpu_us"] for kind in KINDS}
    print(
        "sims' CPU per non-streamed request (context + generation), median: "
        + ", ".join(f"behind {k}: {v['p50']:.0f} µs" for k, v in sims.items())
    )
    return {"summary": summary, "lean_cheaper_by": cheaper_by, "keep_lean": keep}


def main() -> None:
    args = parse_args()
    h.raise_nofile()
    with h.Stack("transport", keep=args.keep, gateway_nodelay=args.gateway_nodelay) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=0, prefill_tokens_per_second=0)
        paced_ctx, paced_gen = h.start_sim_pair(
            stack, tokens_per_second=args.paced_tps, prefill_tokens_per_second=0, model=PACED_MODEL
        )
        options = {"schedule_style": "context_first", "max_local_prefill_tokens": 0}
        for role, sim in (("context", ctx), ("generation", gen)):
            stack.register_worker("bench", h.MODEL, role, sim.url, **options)
        for role, sim in (("context", paced_ctx), ("generation", paced_gen)):
            stack.register_worker("bench-paced", PACED_MODEL, role, sim.url, **options)
        stack.pool_settings()
        key = stack.create_api_key("bench")
        gateways = {
            kind: stack.start_gateway({"WORKER_TRANSPORT": kind}, expect_pools=["bench", "bench-paced"]) for kind in KINDS
        }
        sims = {"sim-context": ctx.pid, "sim-generation": gen.pid}
        config = {k: getattr(args, k) for k in ("repetitions", "concurrency", "requests", "streams", "tokens",
                                                "paced_streams", "paced_tokens", "paced_tps")}
        print("config:", config)
        started = time.monotonic()
        with h.profiled([g.pid for g in gateways.values()], h.result_name(args, "transport") + "-gateway", args.profile):
            result = asyncio.run(run(args, gateways, key, sims))
        print(f"(took {time.monotonic() - started:.0f} s)")
    h.write_result(h.result_name(args, "transport"), {"config": config, **result})


if __name__ == "__main__":
    main()
