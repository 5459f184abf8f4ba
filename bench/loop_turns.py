#!/usr/bin/env python
"""Event-loop turns from a request's arrival to its first body bytes: the gateway and the framework floors.

    .venv/bin/python bench/loop_turns.py

Under a burst every turn of daphne's event loop is a pass over all the work that is ready (every
other stream's arrivals, tokens and endings), so a request whose path to its first bytes crosses
more turns waits that many more passes: in a 200-stream burst the gateway's first content p50 was
16-24 × the framework floor's while its CPU per request was 3.5-5 × (bench/results/2026-12-06-framework-floor.md).
A turn is crossed wherever the path waits for another task (a new task, a future set elsewhere) or
for a socket. This counts them, exactly, one request at a time on one keep-alive connection, for
the small request (context phase skipped, unpaced sims): the gateway, and bench/framework_floor.py's
`relay` and `relay-aiohttp` floors. A streamed floor writes its opening events before it calls the
worker, so for the floors only the non-streamed count (the whole answer, written once the worker's
answer is in) compares with the gateway's first content. The counter is bench/loop_turns_app.py,
wrapped around each application (on daphne's PYTHONPATH). Writes bench/results/loop_turns.json.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

TARGETS: dict[str, tuple[str, dict[str, str]]] = {
    "gateway": ("disagg_project.asgi:application", {}),
    "floor relay": ("bench.framework_floor:application", {"FRAMEWORK_FLOOR": "relay"}),
    "floor relay-aiohttp": ("bench.framework_floor:application", {"FRAMEWORK_FLOOR": "relay-aiohttp"}),
}


async def _drive(conn: h.KeepAlive, wire: bytes, n: int) -> None:
    for _ in range(n):
        response = await conn.request(wire, keep_body=True)
        if response.status != 200:
            raise RuntimeError(f"request failed: status {response.status}, error {response.error}")


def counted(gateway: h.GatewayProc, wire: bytes, n: int, out: Path) -> list[int]:
    loop = asyncio.new_event_loop()
    conn = h.KeepAlive(gateway.port)
    try:
        loop.run_until_complete(_drive(conn, wire, 20))  # warm: connections, caches
        os.kill(gateway.pid, signal.SIGUSR2)  # the warm-up's counts out of the way
        time.sleep(0.3)
        loop.run_until_complete(_drive(conn, wire, n))
        out.unlink(missing_ok=True)
        os.kill(gateway.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        samples: list[int] = json.loads(out.read_text())
        return samples
    finally:
        conn.close()
        loop.close()


def main() -> None:
    n = 100
    tmp = Path(tempfile.mkdtemp(prefix="loop-turns-"))
    results: dict[str, dict[str, Any]] = {}
    with h.Stack("loop_turns") as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=0, prefill_tokens_per_second=0)
        skip_context = {"schedule_style": "context_first", "max_local_prefill_tokens": 1_000_000}
        stack.register_worker("bench", h.MODEL, "context", ctx.url, **skip_context)
        stack.register_worker("bench", h.MODEL, "generation", gen.url, **skip_context)
        key = stack.create_api_key("bench")
        for name, (app, settings) in TARGETS.items():
            out = tmp / f"{name.replace(' ', '-')}.json"
            env = {"PYTHONPATH": str(Path(__file__).resolve().parent), "LOOP_TURNS_OUT": str(out), "LOOP_TURNS_APP": app,
                   "FLOOR_UPSTREAM": gen.url, **settings}
            is_gateway = name == "gateway"
            gateway = stack.start_gateway(env, expect_pools={"bench"} if is_gateway else (), application="loop_turns_app:application",
                                          daphne_args=() if is_gateway else ("-v", "0"))
            for mode in ("stream", "nonstream"):
                wire = h.gateway_request(gateway.port, key, h.messages_body("[sim tokens=4]", stream=mode == "stream", max_tokens=4))
                samples = counted(gateway, wire, n, out)
                results[f"{name} {mode}"] = {"turns": dict(sorted(collections.Counter(samples).items())),
                                             "median": sorted(samples)[len(samples) // 2]}
    rows = [[label, r["median"], " ".join(f"{t}×{c}" for t, c in r["turns"].items())] for label, r in results.items()]
    h.print_table(f"event-loop turns from arrival to the first body bytes ({n} requests each; small request, unpaced sims)",
                  ("target mode", "median", "turns × requests"), rows, digits=0)
    print("(a streamed floor writes its opening before it calls the worker: compare its non-streamed count)")
    h.write_result("loop_turns", {"requests": n, "results": results})


if __name__ == "__main__":
    main()
