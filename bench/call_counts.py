#!/usr/bin/env python
"""Calls per relayed token and per request in a live gateway, counted (cProfile), not sampled.

    .venv/bin/python bench/call_counts.py                       # paced streams, 4 and 400 tokens
    .venv/bin/python bench/call_counts.py --root /tmp/base      # the gateway of another checkout

Under load every Python call on the per-token path costs ~0.25 µs in cache misses (issue 12's sixth
round), and sampled A/Bs of a change worth a call or two sit inside run-to-run noise: a count is
exact and needs no quiet machine. A gateway runs with `bench/call_profile` on its PYTHONPATH, which
turns cProfile on and off on SIGUSR2 in its event loop's thread. It relays N short streams (4
tokens) and M long ones (400 tokens), one at a time over one keep-alive connection, from a sim
worker pacing its tokens (one token per read, as a real decode worker sends them); the context
phase is skipped. Per token = (long − short) / 396, per request = short − 4 × per token. Printed:
Python and builtin calls per token and per request, and the functions making them; the profiles'
times are cProfile's (inflated), so only counts are reported. Writes bench/results/call_counts.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402

SHORT, LONG = 4, 400
PROFILE_SITE = Path(__file__).resolve().parent / "call_profile"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=100, help="N short streams counted (default 100)")
    parser.add_argument("--long", type=int, default=10, help="M long streams counted (default 10)")
    parser.add_argument("--tokens-per-second", type=float, default=500.0, help="the sim's pace per stream (default 500)")
    parser.add_argument("--root", type=Path, help="run the gateway from this checkout of the project (another commit)")
    parser.add_argument("--top", type=int, default=40, help="functions listed per token (default 40)")
    parser.add_argument("--name", default="call_counts", help="result file name")
    return parser.parse_args()


def counted(gateway: h.GatewayProc, wire: bytes, n: int, out: Path) -> dict[tuple[str, int, str], int]:
    """Calls per function over n streams on one connection, profiled in the gateway."""
    loop = asyncio.new_event_loop()
    conn = h.KeepAlive(gateway.port)
    try:
        loop.run_until_complete(_drive(conn, wire, 5))  # warm: connections, caches
        os.kill(gateway.pid, signal.SIGUSR2)
        time.sleep(0.2)
        loop.run_until_complete(_drive(conn, wire, n))
        os.kill(gateway.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # written in one go, but let it finish
    finally:
        conn.close()
        loop.close()
    stats = pstats.Stats(str(out))
    return {key: value[1] for key, value in stats.stats.items()}  # type: ignore[attr-defined]


async def _drive(conn: h.KeepAlive, wire: bytes, n: int) -> None:
    for _ in range(n):
        response = await conn.request(wire, keep_body=True)
        if response.status != 200 or response.body is None or b"event: message_stop" not in response.body:
            raise RuntimeError(f"request failed: status {response.status}, error {response.error}")


def label(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    for marker in ("site-packages/", str(h.PROJECT_ROOT) + "/"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    else:
        filename = re.sub(r"^.*/lib/python3\.\d+/", "", filename)  # the standard library
    return f"{filename}:{line} {name}"


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="call-counts-"))
    with h.Stack("call_counts") as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=args.tokens_per_second, prefill_tokens_per_second=0)
        skip_context = {"schedule_style": "context_first", "max_local_prefill_tokens": 1_000_000}
        stack.register_worker("bench", h.MODEL, "context", ctx.url, **skip_context)
        stack.register_worker("bench", h.MODEL, "generation", gen.url, **skip_context)
        key = stack.create_api_key("bench")
        out = tmp / "calls.prof"
        env = {"PYTHONPATH": str(PROFILE_SITE), "CALL_PROFILE_OUT": str(out)}
        gateway = stack.start_gateway(env, expect_pools={"bench"}, root=args.root)
        counts = {}
        for kind, tokens, n in (("short", SHORT, args.short), ("long", LONG, args.long)):
            wire = h.gateway_request(gateway.port, key, h.messages_body(f"[sim tokens={tokens}]", stream=True, max_tokens=tokens))
            out.unlink(missing_ok=True)
            calls = counted(gateway, wire, n, out)
            counts[kind] = {k: v / n for k, v in calls.items()}
    keys = set(counts["short"]) | set(counts["long"])
    per_token = {k: (counts["long"].get(k, 0.0) - counts["short"].get(k, 0.0)) / (LONG - SHORT) for k in keys}
    per_request = {k: counts["short"].get(k, 0.0) - SHORT * per_token[k] for k in keys}

    def totals(calls: dict[tuple[str, int, str], float]) -> tuple[float, float]:
        python = sum(v for k, v in calls.items() if k[0] != "~")
        return python, sum(calls.values()) - python

    token_py, token_builtin = totals(per_token)
    request_py, request_builtin = totals(per_request)
    rows = [[label(k), v] for k, v in sorted(per_token.items(), key=lambda kv: -kv[1]) if v >= 0.05][: args.top]
    h.print_table("calls per relayed token, by function (paced stream, one token per read)", ("function", "calls"), rows, digits=2)
    h.print_table("totals", ("", "Python calls", "builtin calls"),
                  [["per relayed token", token_py, token_builtin], ["per request (4-token stream)", request_py, request_builtin]], digits=1)
    h.write_result(args.name, {
        "config": {"short": args.short, "long": args.long, "tokens_per_second": args.tokens_per_second,
                   "root": str(args.root) if args.root else None},
        "per_token": {"python_calls": token_py, "builtin_calls": token_builtin,
                      "functions": {label(k): v for k, v in per_token.items() if abs(v) >= 0.01}},
        "per_request": {"python_calls": request_py, "builtin_calls": request_builtin,
                        "functions": {label(k): v for k, v in per_request.items() if abs(v) >= 0.5}},
    })


if __name__ == "__main__":
    main()
