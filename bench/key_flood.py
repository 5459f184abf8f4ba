#!/usr/bin/env python
"""What a flood of bad API keys costs the gateway, and a valid key beside it.

    .venv/bin/python bench/key_flood.py                    # 3,000 refusals per kind, 2 rounds
    .venv/bin/python bench/key_flood.py --quick            # 600 refusals per kind, 1 round
    .venv/bin/python bench/key_flood.py --b-root /tmp/base # the same against another checkout, same run
    .venv/bin/python bench/key_flood.py --throttle 60      # with the per-address throttle on (429s)

A real gateway (one daphne process, SQLite, a sim worker pair unpaced) and a valid key. The flooding
client sends `POST /v1/messages` (a small body) with a bad key, each on a connection of its own
(a refusal at the headers closes its connection), over --connections threads, from a process of
its own at nice 10 (an attacker's CPU is not the gateway's: on this 2-core machine a client at
full priority slows its neighbours by taking a core). Kinds of bad key:

- `repeated`: one unknown key of the old form (`sk-gw-` + 43 characters), every time;
- `random`: a new random key of that form each time (the flood of issue 42: each was a lookup);
- `random-issued`: a new random key of the issued form (`sk-gw2-`, a random tag) each time;
- `malformed`: random text of random length.

The gateway runs with GATEWAY_AUTH_FAILURES_PER_MINUTE=0 (every client here is loopback: with
the throttle on, all but the first 60 refusals are 429s, as cheap) unless --throttle.

Per kind:
1. The cost: the flood with nothing else sent, --cost-rounds times in a rotating order of the
   kinds (the median kept); the gateway's CPU seconds over it (`/proc`, all threads, less its
   idle rate measured just before) per refused request; its RSS before and after.
   (After a warm-up flood, not measured: a new process's heap grows over its first thousands of
   requests whatever they are.)
2. The valid key beside it, --rounds times: a window of --alone-s with only the valid key's client
   (small non-streamed /v1/messages one at a time, each timed), then the flood again, offered at
   --rate a second (1,000), while it goes on; p50/p99 under the flood against the window alone
   just before it. Unpaced (--rate 0) the flood takes all the event loop leaves, whatever a refusal
   costs, and the valid key queues behind it.

Targets (issue 42): CPU per refused request of a random-key flood <= 1.5 x a repeated key's; RSS
flat; the valid key's p99 under the flood <= 2 x its p99 alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

POOL = "bench-pool"
KINDS = ("repeated", "random", "random-issued", "malformed")
BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, help="refused requests per flood (default 3000; --quick 600)")
    parser.add_argument("--connections", type=int, default=16, help="the flooding client's parallel connections (default 16)")
    parser.add_argument("--rate", type=float, default=1000.0,
                        help="refused requests a second offered beside the valid key (default 1000; 0: as fast as answered)")
    parser.add_argument("--rounds", type=int, help="floods timed beside the valid key per kind (default 2; --quick 1)")
    parser.add_argument("--cost-rounds", type=int, help="floods of each kind measured alone, the median kept (default 3; --quick 1)")
    parser.add_argument("--alone-s", type=float, default=5.0, help="the valid key's window alone before each timed flood")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"kinds of bad key, comma-separated (default {','.join(KINDS)})")
    parser.add_argument("--throttle", type=int, default=0, help="the gateway's GATEWAY_AUTH_FAILURES_PER_MINUTE (default 0: off)")
    parser.add_argument("--b-root", type=Path, help="also run a gateway from this checkout (same database and workers), after this one's")
    return h.parse_args(parser, quick={"requests": 600, "rounds": 1, "cost_rounds": 1}, full={"requests": 3000, "rounds": 2, "cost_rounds": 3})


def bad_key(kind: str, fixed: str) -> str:
    if kind == "repeated":
        return fixed
    if kind == "random":
        return "sk-gw-" + secrets.token_urlsafe(32)
    if kind == "random-issued":
        return "sk-gw2-" + "".join(random.choices(BASE62, k=49))
    return "".join(random.choices(string.ascii_letters + string.digits + "-_.~+/=", k=random.randint(1, 120)))


def read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError("the gateway closed the connection without an answer")
        data += chunk
    return int(data.split(b" ", 2)[1])


def flood(port: int, kind: str, requests: int, gateway_pid: int, connections: int, rate: float) -> dict[str, Any]:
    """`requests` bad-key requests, each on a new connection, built in advance, `rate` a second
    (0: each as soon as a connection is free): the statuses, the wall time and the gateway's CPU
    seconds over them."""
    body = h.messages_body("[sim tokens=4]", stream=False, max_tokens=4)
    fixed = "sk-gw-" + secrets.token_urlsafe(32)
    built = [
        h.build_request("POST", port, "/v1/messages", body, {"content-type": "application/json", "x-api-key": bad_key(kind, fixed)})
        for _ in range(requests)
    ]
    lock = threading.Lock()
    statuses: Counter[int] = Counter()
    remaining = iter(enumerate(built))
    errors: list[BaseException] = []

    def send() -> None:
        try:
            while True:
                with lock:
                    index, request = next(remaining, (0, None))
                if request is None:
                    return
                if rate > 0:  # paced: request i is due i/rate s after the start
                    time.sleep(max(0.0, started + index / rate - time.monotonic()))
                with socket.create_connection(("127.0.0.1", port)) as sock:
                    sock.sendall(request)
                    status = read_status(sock)
                with lock:
                    statuses[status] += 1
        except BaseException as exc:  # reported by the parent
            errors.append(exc)

    started = time.monotonic()
    cpu_start = h.proc_cpu_seconds(gateway_pid)
    threads = [threading.Thread(target=send) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ended = time.monotonic()
    cpu = h.proc_cpu_seconds(gateway_pid) - cpu_start
    if errors:
        raise errors[0]
    return {"statuses": {str(k): v for k, v in statuses.items()}, "wall_s": ended - started, "cpu_s": cpu,
            "started_monotonic": started, "ended_monotonic": ended}  # fmt: skip


def run_flood(gateway: h.GatewayProc, kind: str, args: argparse.Namespace, rate: float = 0.0) -> dict[str, Any]:
    child = subprocess.run(
        [sys.executable, __file__, "--flood", str(gateway.port), kind, str(args.requests), str(gateway.pid), str(args.connections),
         str(rate)],
        capture_output=True, text=True, check=True,
    )
    return dict(json.loads(child.stdout.strip().splitlines()[-1]))


class ApiTimer(threading.Thread):
    """Small non-streamed requests with the valid key, one at a time on one keep-alive connection."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(name="api-timer", daemon=True)
        self.client = httpx.Client(base_url=url, timeout=30, headers={"x-api-key": key, "anthropic-version": h.ANTHROPIC_VERSION})
        self.body = h.messages_body("[sim tokens=4]", stream=False, max_tokens=4)
        self.lock = threading.Lock()
        self.samples: list[tuple[float, float]] = []
        self.errors: Counter[int] = Counter()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            response = self.client.post("/v1/messages", content=self.body, headers={"content-type": "application/json"})
            took = time.monotonic() - started
            with self.lock:
                if response.status_code == 200:
                    self.samples.append((started, took))
                else:
                    self.errors[response.status_code] += 1
            time.sleep(0.005)  # a client that pauses between requests: latency, not throughput

    def between(self, start: float, end: float) -> list[float]:
        with self.lock:
            return [took for at, took in self.samples if start <= at < end]


def measure(gateway: h.GatewayProc, key: str, kinds: list[str], args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # Warm-up, not measured: the first few thousand requests of a process grow its heap (the
    # allocator's arenas, Twisted's and daphne's caches) whatever their key.
    run_flood(gateway, "repeated", args)
    # 1. The cost of each kind, nothing else running against the gateway: --cost-rounds floods of
    # each, the kinds' order rotated every round (other sessions' load drifts), the median kept.
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for turn in range(args.cost_rounds):
        for kind in kinds[turn % len(kinds) :] + kinds[: turn % len(kinds)]:
            idle_start = h.proc_cpu_seconds(gateway.pid)
            time.sleep(2.0)
            idle_per_s = (h.proc_cpu_seconds(gateway.pid) - idle_start) / 2.0  # heartbeats, registry refresh
            rss_before = h.rss_mib(gateway.pid)
            run = run_flood(gateway, kind, args)
            refused = sum(run["statuses"].values())
            cpu = max(0.0, run["cpu_s"] - idle_per_s * run["wall_s"])
            runs[kind].append({
                "answers": run["statuses"], "wall_s": run["wall_s"], "refused_per_s": refused / run["wall_s"],
                "gateway_cpu_s": cpu, "gateway_cpu_ms_per_refusal": cpu / refused * 1000, "idle_cpu_s_per_s": idle_per_s,
                "rss_mib_before": rss_before, "rss_mib_after": h.rss_mib(gateway.pid),
            })  # fmt: skip
    for kind in kinds:
        ordered = sorted(runs[kind], key=lambda r: r["gateway_cpu_ms_per_refusal"])
        median = dict(ordered[len(ordered) // 2])
        answers: Counter[str] = Counter()
        for r in runs[kind]:
            answers.update(r["answers"])
        median["answers"] = dict(answers)
        median["rss_mib_before"] = min(r["rss_mib_before"] for r in runs[kind])
        median["rss_mib_after"] = max(r["rss_mib_after"] for r in runs[kind])
        median["runs"] = runs[kind]
        results[kind] = median
    results["rss_mib_over_the_cost_floods"] = [runs[kinds[0]][0]["rss_mib_before"], h.rss_mib(gateway.pid)]
    # 2. The valid key beside each kind.
    timer = ApiTimer(gateway.url, key)
    timer.start()
    for kind in kinds:
        rounds = []
        for _ in range(args.rounds):
            alone_start = time.monotonic()
            time.sleep(args.alone_s)
            alone_end = time.monotonic()
            run = run_flood(gateway, kind, args, args.rate)
            alone = h.distribution(timer.between(alone_start, alone_end))
            under = h.distribution(timer.between(run["started_monotonic"], run["ended_monotonic"]))
            rounds.append({"alone_ms": h.in_ms(alone), "under_flood_ms": h.in_ms(under),
                           "p99_ratio": under["p99"] / alone["p99"] if under["n"] and alone["n"] else None})  # fmt: skip
        results[kind]["valid_key_rounds"] = rounds
        ratios = sorted(r["p99_ratio"] for r in rounds if r["p99_ratio"] is not None)
        results[kind]["valid_key_p99_ratio_median"] = ratios[len(ratios) // 2] if ratios else None
    timer.stopping.set()
    timer.join(35)
    results["valid_key_errors"] = dict(timer.errors)
    return results


def report(label: str, results: dict[str, Any], kinds: list[str]) -> None:
    repeated = results.get("repeated", {}).get("gateway_cpu_ms_per_refusal")
    h.print_table(
        f"{label}: the gateway's cost per refused request, nothing else running (median of the cost rounds; RSS over all)",
        ["kind", "answers", "refused/s", "CPU ms/refusal", "x repeated", "RSS MiB min before", "max after"],
        [
            [kind, ", ".join(f"{s}: {n}" for s, n in sorted(r["answers"].items())), r["refused_per_s"], r["gateway_cpu_ms_per_refusal"],
             r["gateway_cpu_ms_per_refusal"] / repeated if repeated else None, r["rss_mib_before"], r["rss_mib_after"]]
            for kind, r in ((k, results[k]) for k in kinds)
        ],
        digits=3,
    )  # fmt: skip
    rows = []
    for kind in kinds:
        for i, r in enumerate(results[kind]["valid_key_rounds"]):
            rows.append([kind, i + 1, r["alone_ms"]["n"], r["alone_ms"].get("p50"), r["alone_ms"].get("p99"),
                         r["under_flood_ms"]["n"], r["under_flood_ms"].get("p50"), r["under_flood_ms"].get("p99"), r["p99_ratio"]])  # fmt: skip
    h.print_table(f"{label}: the valid key's latency (ms), alone then beside the flood (offered at --rate)",
                  ["kind", "round", "alone n", "p50", "p99", "under n", "p50", "p99", "p99 x alone"], rows)  # fmt: skip
    if repeated and "random" in results:
        ratio = results["random"]["gateway_cpu_ms_per_refusal"] / repeated
        print(f"{label}: random keys cost {ratio:.2f} x a repeated key per refusal (target <= 1.5): "
              f"{h.verdict(ratio <= 1.5)}; valid key errors: {results['valid_key_errors']}")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--flood":  # the flooding child
        os.nice(10)
        port, kind, requests, pid, connections = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
        print(json.dumps(flood(port, kind, requests, pid, connections, float(sys.argv[7]))))
        return
    args = parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    settings: dict[str, Any] = {"GATEWAY_AUTH_FAILURES_PER_MINUTE": args.throttle}
    with h.Stack("key_flood", keep=args.keep) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=0, prefill_tokens_per_second=0)
        for role, sim in (("context", ctx), ("generation", gen)):
            stack.register_worker(POOL, h.MODEL, role, sim.url, schedule_style="context_first")
        key = stack.create_api_key("bench-key-flood")
        results: dict[str, Any] = {
            "requests": args.requests, "connections": args.connections, "rate": args.rate, "throttle": args.throttle, "key_form": key[:7],
        }  # fmt: skip
        roots: list[tuple[str, Path | None]] = [("this checkout", None)]
        if args.b_root:
            roots.append((f"b: {args.b_root}", args.b_root))
        for label, root in roots:
            gateway = stack.start_gateway(settings, expect_pools=[POOL], root=root)
            h.wait_for_quiet(args.quiet_wait)
            results[label] = measure(gateway, key, kinds, args)
            report(label, results[label], kinds)
            gateway.stop()
        h.write_result(h.result_name(args, "key_flood"), results)


if __name__ == "__main__":
    main()
