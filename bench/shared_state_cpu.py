#!/usr/bin/env python
"""The gateway CPU that Redis-backed admission and limit checks cost, per request and per script
call, in fresh child processes against a private redis-server, round after round.

    .venv/bin/python bench/shared_state_cpu.py                       # this checkout
    .venv/bin/python bench/shared_state_cpu.py --root /tmp/base      # and another, rounds alternated

Per request: bench/tenants.py's admission-path measurement (`--micro-child`: `check_limits`,
`admit`, the slot's release and the key's settle, as the gateway runs them; four scripts with
Redis), run by the checkout under test. Per call: the client alone, a one-line script
(`return 1`) awaited one after another (`run`), and sent in the background (`spawn`) with one
awaited call after each, as a request's end and the next request's check go; and awaited by 16
callers at once (a loaded gateway: what one turn of the loop gives leaves in one write). CPU is
time.process_time of the child (user + system: the kernel's loopback work on send counts), not
the Redis server's. Each round is a fresh child; printed: median and spread over rounds. Writes
bench/results/shared_state_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402

from tests.support.ports import unused_port  # noqa: E402

# The per-call child: run with the checkout under test on its path (Script and get_shared_state
# are the public names in every checkout measured).
CALLS = """
import asyncio, json, os, sys, time
import django
django.setup()
from disagg_project import Script, get_shared_state

n = int(sys.argv[1])
one = Script("return 1")

async def main():
    shared = get_shared_state()
    keys = ["bench-shared-state:k"]
    for _ in range(500):
        await shared.run(one, keys, [1])
    out = {}
    cpu = time.process_time()
    for _ in range(n):
        await shared.run(one, keys, [1])
    out["run, awaited"] = (time.process_time() - cpu) / n * 1e6
    cpu = time.process_time()
    for _ in range(n):
        shared.spawn(one, keys, [1])
        await shared.run(one, keys, [1])
    drain = getattr(shared, "drain", None)
    if drain is not None:
        await drain()
    else:
        await asyncio.gather(*shared._background)
    out["spawn + run"] = (time.process_time() - cpu) / n * 1e6

    async def caller():
        for _ in range(n // 16):
            await shared.run(one, keys, [1])

    cpu = time.process_time()
    await asyncio.gather(*(caller() for _ in range(16)))
    out["run, 16 callers at once"] = (time.process_time() - cpu) / (n // 16 * 16) * 1e6
    print("CALLS " + json.dumps(out), flush=True)

asyncio.run(main())
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", action="append", default=[], help="another checkout to measure too (repeatable)")
    parser.add_argument("--rounds", type=int, help="fresh children per checkout (default 5; --quick 1)")
    parser.add_argument("--iterations", type=int, help="requests or calls per case per round (default 10000; --quick 1000)")
    return h.parse_args(parser, quick={"rounds": 1, "iterations": 1000}, full={"rounds": 5, "iterations": 10000})


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = unused_port()
    log = open(tmp / "redis.log", "wb")
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        if ping.stdout.strip() == "PONG":
            return process, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("redis-server did not start")


def child(root: Path, redis_url: str, argv: list[str], tag: str) -> dict[str, Any]:
    env = dict(os.environ) | {
        "DJANGO_SETTINGS_MODULE": "disagg_project.settings", "DEBUG": "1", "PYTHONPATH": str(root),
        "REDIS_URL": redis_url, "REDIS_KEY_PREFIX": f"bench-shared-state-{os.getpid()}:",
    }
    result = subprocess.run([h.PYTHON, *argv], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    line = [line for line in result.stdout.splitlines() if line.startswith(tag + " ")]
    if result.returncode != 0 or not line:
        raise RuntimeError(f"the child in {root} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return dict(json.loads(line[0][len(tag) + 1:]))


def one_round(root: Path, redis_url: str, n: int) -> dict[str, float]:
    micro = child(root, redis_url, [str(root / "bench" / "tenants.py"), "--micro-child", "--micro-iterations", str(n)], "MICRO")
    calls = child(root, redis_url, ["-c", CALLS, str(n)], "CALLS")
    out = {name: float(v["cpu_us"]) for name, v in micro.items() if isinstance(v, dict)}
    return out | {f"per call: {name}": float(v) for name, v in calls.items()}


def main() -> None:
    args = parse_args()
    roots = [h.PROJECT_ROOT] + [Path(r).resolve() for r in args.root]
    quiet = h.wait_for_quiet(args.quiet_wait)
    print(quiet, flush=True)
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    redis, url = start_redis(tmp)
    rounds: dict[str, list[dict[str, float]]] = {str(r): [] for r in roots}
    try:
        for i in range(args.rounds):
            for root in roots:
                rounds[str(root)].append(one_round(root, url, args.iterations))
                print(f"round {i + 1}/{args.rounds} {root}", flush=True)
    finally:
        redis.terminate()
        redis.wait(10)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for root, results in rounds.items():
        summary[root] = {
            case: {"median": statistics.median(r[case] for r in results), "min": min(r[case] for r in results),
                   "max": max(r[case] for r in results)}
            for case in results[0]
        }
        h.print_table(f"CPU µs ({root}; {args.rounds} rounds × {args.iterations})", ("case", "median", "min", "max"),
                      [[case, v["median"], v["min"], v["max"]] for case, v in summary[root].items()], digits=1)
    path = h.write_result(h.result_name(args, "shared_state_cpu"), {
        "args": vars(args), "quiet": quiet, "machine": h.machine_info(), "rounds": rounds, "summary": summary,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
