#!/usr/bin/env python
"""Non-streamed requests per second through the gateway, audit rows included.

    .venv/bin/python bench/nonstream_rps.py                        # SQLite, one daphne process
    .venv/bin/python bench/nonstream_rps.py --concurrency 64 --requests 5000
    .venv/bin/python bench/nonstream_rps.py --database-url postgres://postgres@127.0.0.1:5432/bench_gateway --processes both
    .venv/bin/python bench/nonstream_rps.py --quick                # smoke test, a few seconds

C keep-alive connections of a raw-socket client send `POST /v1/messages` (`stream: false`,
`[sim tokens=4]`) back to back until N requests are done. The same load is then sent straight to
the sim pair (context POST, then the generation POST with the handoff, read to its end — what the
gateway does for a request), by the script itself, at the same concurrency. Finally requests are
sent one at a time, gateway and direct interleaved, for the added latency of one request on an
otherwise idle machine.

`--processes 2` starts two daphne processes on the same database and splits the connections
between them (each process's figures and the total are reported); `--processes both` runs one
process, then two, and reports the scaling (target on PostgreSQL: two ≥ 1.8 × one).
`--database-url postgres://…` creates the database (psycopg) when it is missing; each run uses
its own pool, model and key names, so a database can be reused.

After the run the script waits for the audit writer and checks that the number of terminal
`MessageRequest` rows with status `completed` equals the number of requests sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

SCALING_TARGET = 1.8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, help="C keep-alive connections (default 32; --quick 8)")
    parser.add_argument("--requests", type=int, help="N requests per load phase (default 3000; --quick 200)")
    parser.add_argument("--sequential", type=int, help="one-at-a-time pairs for the added latency (default 300; --quick 30)")
    parser.add_argument("--warmup", type=int, help="requests before measuring (default 100; --quick 20)")
    parser.add_argument("--tokens", type=int, default=4, help="output tokens per request (default 4)")
    parser.add_argument("--database-url", help="default: a new SQLite file in a temporary directory")
    parser.add_argument("--processes", choices=("1", "2", "both"), default="1", help="daphne processes (default 1)")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct baseline load phase")
    args = h.parse_args(
        parser,
        quick={"concurrency": 8, "requests": 200, "sequential": 30, "warmup": 20},
        full={"concurrency": 32, "requests": 3000, "sequential": 300, "warmup": 100},
    )
    return args


def ensure_postgres_database(url: str) -> None:
    """CREATE DATABASE when it does not exist (connecting to the server's `postgres` database)."""
    import psycopg
    from psycopg import sql

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(("postgresql", parts.netloc, "/postgres", parts.query, ""))
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            print(f"created database {name}")


# --- load ------------------------------------------------------------------------------------------


class Counter:
    def __init__(self, total: int) -> None:
        self.total = total
        self.next = 0

    def take(self) -> bool:
        if self.next >= self.total:
            return False
        self.next += 1
        return True


async def gateway_load(ports: list[int], key: str, model: str, concurrency: int, total: int, tokens: int) -> dict[str, Any]:
    """C connections (spread over the ports) sending non-streamed requests until `total` are done."""
    counter = Counter(total)
    wires = {p: h.gateway_request(p, key, h.messages_body(f"[sim tokens={tokens}]", stream=False, model=model)) for p in ports}
    latencies: dict[int, list[float]] = {p: [] for p in ports}
    failures: dict[int, int] = {p: 0 for p in ports}
    statuses: dict[int, int] = {}

    async def client(port: int) -> None:
        conn = h.KeepAlive(port)
        try:
            while counter.take():
                resp = await conn.request(wires[port])
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
                if resp.status != 200 or resp.error or resp.done_at is None:
                    failures[port] += 1
                    continue
                latencies[port].append(resp.done_at - resp.sent_at)
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(ports[i % len(ports)]) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"wall": wall, "latencies": latencies, "failures": failures, "statuses": statuses, "sent": counter.next}


class DirectClient:
    """What the gateway does for one non-streamed request, done by hand against the sim pair."""

    def __init__(self, ctx_port: int, gen_port: int, tokens: int) -> None:
        self.ctx = h.KeepAlive(ctx_port)
        self.gen = h.KeepAlive(gen_port)
        self.ctx_port = ctx_port
        self.gen_port = gen_port
        self.chat = {
            "model": h.MODEL,
            "max_tokens": 100000,
            "messages": [{"role": "user", "content": f"Hello [sim tokens={tokens}]"}],
        }

    async def one(self) -> tuple[bool, float]:
        t0 = time.perf_counter()
        context = dict(self.chat)
        context["stream"] = False
        context["disaggregated_params"] = {
            "request_type": "context_only",
            "disagg_request_id": random.getrandbits(62),
            "schedule_style": "context_first",
        }
        resp = await self.ctx.request(h.worker_request(self.ctx_port, context), keep_body=True)
        if resp.status != 200 or resp.error or resp.body is None:
            return False, 0.0
        answer = json.loads(bytes(resp.body))
        params = answer["choices"][0]["disaggregated_params"]
        generation = dict(self.chat)
        generation["stream"] = True
        generation["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        generation["disaggregated_params"] = {**params, "request_type": "generation_only"}
        generation["prompt_token_ids"] = answer.get("prompt_token_ids")
        resp = await self.gen.request(h.worker_request(self.gen_port, generation), count=b"data: [DONE]")
        if resp.status != 200 or resp.error or resp.done_at is None or resp.count != 1:
            return False, 0.0
        return True, resp.done_at - t0

    def close(self) -> None:
        self.ctx.close()
        self.gen.close()


async def direct_load(ctx_port: int, gen_port: int, concurrency: int, total: int, tokens: int) -> dict[str, Any]:
    counter = Counter(total)
    latencies: list[float] = []
    failures = [0]

    async def client() -> None:
        direct = DirectClient(ctx_port, gen_port, tokens)
        try:
            while counter.take():
                ok, latency = await direct.one()
                if ok:
                    latencies.append(latency)
                else:
                    failures[0] += 1
        finally:
            direct.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"wall": time.perf_counter() - t0, "latencies": latencies, "failures": failures[0]}


async def sequential(ports: list[int], key: str, model: str, ctx_port: int, gen_port: int, pairs: int, tokens: int) -> dict[str, Any]:
    wires = {p: h.gateway_request(p, key, h.messages_body(f"[sim tokens={tokens}]", stream=False, model=model)) for p in ports}
    conns = {p: h.KeepAlive(p) for p in ports}
    direct = DirectClient(ctx_port, gen_port, tokens)
    gateway_lat: list[float] = []
    direct_lat: list[float] = []
    added: list[float] = []
    sent = 0
    failures = 0
    rng = random.Random(2)
    for i in range(pairs):
        port = ports[i % len(ports)]
        order = ["gateway", "direct"]
        rng.shuffle(order)
        this: dict[str, float] = {}
        for kind in order:
            if kind == "gateway":
                sent += 1
                resp = await conns[port].request(wires[port])
                if resp.status == 200 and not resp.error and resp.done_at is not None:
                    this[kind] = resp.done_at - resp.sent_at
                else:
                    failures += 1
            else:
                ok, latency = await direct.one()
                if ok:
                    this[kind] = latency
                else:
                    failures += 1
        if "gateway" in this:
            gateway_lat.append(this["gateway"])
        if "direct" in this:
            direct_lat.append(this["direct"])
        if len(this) == 2:
            added.append(this["gateway"] - this["direct"])
        await asyncio.sleep(0.002)
    for conn in conns.values():
        conn.close()
    direct.close()
    return {"gateway": gateway_lat, "direct": direct_lat, "added": added, "sent": sent, "failures": failures}


# --- audit -----------------------------------------------------------------------------------------


def audit_counts(stack: h.Stack, pool: str) -> dict[str, int]:
    code = (
        "import json; from django.db.models import Count; from messages_api.models import MessageRequest as M; "
        f"print(json.dumps(dict(M.objects.filter(pool_name={pool!r}).values_list('status').annotate(n=Count('id')))))"
    )
    return json.loads(stack.manage("shell", "-c", code).strip().splitlines()[-1])


def wait_audit(stack: h.Stack, pool: str, expected: int, timeout: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = audit_counts(stack, pool)
        if counts.get("completed", 0) >= expected and not counts.get("in_progress"):
            return counts
        time.sleep(0.5)
    return counts


# --- one configuration -----------------------------------------------------------------------------


async def measure(
    args: argparse.Namespace,
    gateways: list[h.GatewayProc],
    key: str,
    model: str,
    ctx: h.SimProc,
    gen: h.SimProc,
    label: str,
) -> dict[str, Any]:
    ports = [g.port for g in gateways]
    ctx_port, gen_port = h.port_of(ctx.url), h.port_of(gen.url)
    sent = 0
    # Warm-up: every process, its upstream pool and the direct connections.
    warm = await gateway_load(ports, key, model, min(args.concurrency, 8), args.warmup, args.tokens)
    sent += warm["sent"]
    await direct_load(ctx_port, gen_port, min(args.concurrency, 8), max(args.warmup // 2, 4), args.tokens)
    quiet = h.wait_for_quiet(args.quiet_wait)

    pids = {f"gateway{i}" if len(gateways) > 1 else "gateway": g.pid for i, g in enumerate(gateways)}
    pids.update({ctx.name: ctx.pid, gen.name: gen.pid})
    meter = h.CpuMeter(pids).start()
    load = await gateway_load(ports, key, model, args.concurrency, args.requests, args.tokens)
    cpu = meter.stop()
    sent += load["sent"]
    all_lat = [x for lats in load["latencies"].values() for x in lats]
    ok = len(all_lat)
    rps = ok / load["wall"]

    direct: dict[str, Any] | None = None
    direct_cpu: dict[str, float] = {}
    if not args.no_direct:
        dmeter = h.CpuMeter({ctx.name: ctx.pid, gen.name: gen.pid}).start()
        direct = await direct_load(ctx_port, gen_port, args.concurrency, args.requests, args.tokens)
        direct_cpu = dmeter.stop()

    seq = await sequential(ports, key, model, ctx_port, gen_port, args.sequential, args.tokens)
    sent += seq["sent"]

    gw_dist = h.distribution(all_lat)
    rows = [["gateway" + (f" ×{len(gateways)} processes" if len(gateways) > 1 else ""), ok, load["wall"], rps] +
            h.dist_row("", gw_dist, 1000)[2:]]
    per_process = []
    if len(gateways) > 1:
        for i, g in enumerate(gateways):
            lats = load["latencies"][g.port]
            d = h.distribution(lats)
            rows.append([f"  process {i + 1} (pid {g.pid})", len(lats), load["wall"], len(lats) / load["wall"]] + h.dist_row("", d, 1000)[2:])
            per_process.append({
                "pid": g.pid,
                "requests": len(lats),
                "rps": len(lats) / load["wall"],
                "latency_ms": h.in_ms(d),
                "cpu_s": cpu[f"gateway{i}"],
                "cpu_us_per_request": cpu[f"gateway{i}"] / max(len(lats), 1) * 1e6,
                "peak_rss_mib": h.hwm_mib(g.pid),
            })
    direct_dist: dict[str, float] = {}
    direct_rps = 0.0
    if direct is not None:
        direct_dist = h.distribution(direct["latencies"])
        direct_rps = len(direct["latencies"]) / direct["wall"]
        rows.append(["direct (sim pair, by the script)", len(direct["latencies"]), direct["wall"], direct_rps] +
                    h.dist_row("", direct_dist, 1000)[2:])
    h.print_table(
        f"{label}: {args.requests} non-streamed requests, {args.concurrency} keep-alive connections — latency in ms",
        ("", "ok", "wall s", "req/s", "min", "p50", "p90", "p99", "max"),
        rows,
        digits=2,
    )
    seq_rows = [
        ["gateway", *h.dist_row("", h.distribution(seq["gateway"]), 1000)[1:]],
        ["direct", *h.dist_row("", h.distribution(seq["direct"]), 1000)[1:]],
        ["added (gateway − direct, same pair)", *h.dist_row("", h.distribution(seq["added"]), 1000)[1:]],
    ]
    h.print_table(
        f"{label}: one request at a time ({args.sequential} interleaved pairs) — latency in ms",
        h.DIST_HEADERS,
        seq_rows,
        digits=3,
    )
    gw_cpu = sum(v for k, v in cpu.items() if k.startswith("gateway") and ":" not in k)
    gw_loop = sum(v for k, v in cpu.items() if k.endswith(":loop-thread"))
    cpu_rows = [
        ["gateway CPU per request, µs (all processes)", gw_cpu / max(ok, 1) * 1e6],
        ["  of which event-loop threads, µs", gw_loop / max(ok, 1) * 1e6],
        ["gateway CPU utilisation during the load, % of one core", gw_cpu / load["wall"] * 100],
        ["sim workers' CPU per request (via gateway), µs", (cpu[ctx.name] + cpu[gen.name]) / max(ok, 1) * 1e6],
        ["load generator CPU per request, µs", cpu["loadgen"] / max(ok, 1) * 1e6],
    ]
    if direct is not None and direct["latencies"]:
        cpu_rows.append(["sim workers' CPU per request (direct), µs",
                         (direct_cpu[ctx.name] + direct_cpu[gen.name]) / len(direct["latencies"]) * 1e6])
        cpu_rows.append(["load generator CPU per request (direct), µs", direct_cpu["loadgen"] / len(direct["latencies"]) * 1e6])
    for g in gateways:
        cpu_rows.append([f"gateway pid {g.pid} peak RSS (VmHWM), MiB", h.hwm_mib(g.pid)])
    h.print_table(f"{label}: CPU and memory", ("", "value"), cpu_rows, digits=1)
    print(f"(gateway load phase — {meter.machine_note()})")
    return {
        "processes": len(gateways),
        "concurrency": args.concurrency,
        "requests": args.requests,
        "ok": ok,
        "failures": sum(load["failures"].values()),
        "statuses": load["statuses"],
        "wall_s": load["wall"],
        "rps": rps,
        "latency_ms": h.in_ms(gw_dist),
        "per_process": per_process,
        "cpu_s": cpu,
        "gateway_cpu_us_per_request": gw_cpu / max(ok, 1) * 1e6,
        "gateway_loop_thread_cpu_us_per_request": gw_loop / max(ok, 1) * 1e6,
        "direct": None if direct is None else {
            "ok": len(direct["latencies"]),
            "failures": direct["failures"],
            "wall_s": direct["wall"],
            "rps": direct_rps,
            "latency_ms": h.in_ms(direct_dist),
            "cpu_s": direct_cpu,
        },
        "added_latency_at_concurrency_p50_ms": (gw_dist["p50"] - direct_dist["p50"]) * 1000 if direct_dist.get("n") else None,
        "sequential": {
            "gateway_ms": h.in_ms(h.distribution(seq["gateway"])),
            "direct_ms": h.in_ms(h.distribution(seq["direct"])),
            "added_ms": h.in_ms(h.distribution(seq["added"])),
            "failures": seq["failures"],
        },
        "gateway_requests_sent": sent,
        "machine": meter.machine_note(),
        "quiet": quiet,
        "peak_rss_mib": [h.hwm_mib(g.pid) for g in gateways],
    }


def main() -> None:
    args = parse_args()
    h.raise_nofile()
    run_id = time.strftime("%Y%m%d%H%M%S") + "-" + secrets.token_hex(2)
    if args.database_url and args.database_url.startswith(("postgres://", "postgresql://")):
        ensure_postgres_database(args.database_url)
    # Names unique to this run, so a shared (PostgreSQL) database can be reused between runs.
    pool, model = f"bench-{run_id}", f"sim-model-{run_id}"
    counts = [1, 2] if args.processes == "both" else [int(args.processes)]
    results: dict[str, Any] = {
        "config": {
            "database": "postgresql" if args.database_url and args.database_url.startswith("postgres") else "sqlite",
            "concurrency": args.concurrency,
            "requests": args.requests,
            "tokens": args.tokens,
            "processes": args.processes,
            "gateway_nodelay": args.gateway_nodelay,
            "pool": pool,
        },
        "runs": {},
    }
    with h.Stack("nonstream", database_url=args.database_url, keep=args.keep, gateway_nodelay=args.gateway_nodelay) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=0, prefill_tokens_per_second=0)
        for role, sim in (("context", ctx), ("generation", gen)):
            stack.register_worker(pool, model, role, sim.url, schedule_style="context_first", max_local_prefill_tokens=0)
        key = stack.create_api_key(f"bench-{run_id}")
        total_sent = 0
        for n in counts:
            gateways = [stack.start_gateway({}, expect_pools=[pool]) for _ in range(n)]
            label = f"{n} gateway process{'es' if n > 1 else ''} ({results['config']['database']})"
            with h.profiled([g.pid for g in gateways], f"{h.result_name(args, 'nonstream_rps')}-gateway{n}", args.profile):
                run = asyncio.run(measure(args, gateways, key, model, ctx, gen, label))
            total_sent += run["gateway_requests_sent"]
            results["runs"][str(n)] = run
            # Audit: one terminal row per request, written by the background writer (waited for
            # while the processes still run: stopping them is not part of what is measured).
            counts_by_status = wait_audit(stack, pool, total_sent)
            for g in gateways:
                g.stop()
    completed = counts_by_status.get("completed", 0)
    audit_ok = completed == total_sent and sum(counts_by_status.values()) == total_sent
    print(f"\naudit rows (MessageRequest, pool {pool}): {counts_by_status}; "
          f"completed {completed} / requests sent {total_sent}: {'OK' if audit_ok else 'MISMATCH'}")
    results["audit"] = {"by_status": counts_by_status, "completed": completed, "requests_sent": total_sent, "ok": audit_ok}
    if "1" in results["runs"] and "2" in results["runs"]:
        ratio = results["runs"]["2"]["rps"] / results["runs"]["1"]["rps"]
        results["scaling_two_over_one"] = ratio
        print(f"two processes / one: {ratio:.2f}× (target ≥ {SCALING_TARGET}× on PostgreSQL): "
              f"{h.verdict(ratio >= SCALING_TARGET)}")
    h.write_result(h.result_name(args, "nonstream_rps") + ("" if args.processes == "1" else f"-p{args.processes}")
                   + ("-pg" if results["config"]["database"] == "postgresql" else ""), results)


if __name__ == "__main__":
    main()
