#!/usr/bin/env python
"""Message Batches against their targets (issue 43): the results of a large batch downloaded in
bounded memory; a batch beside interactive traffic; a batch against an SDK script sending the
same items itself.

    .venv/bin/python bench/batches.py                      # every phase (a few minutes)
    .venv/bin/python bench/batches.py --quick              # a smoke test
    .venv/bin/python bench/batches.py --phases download --download-items 100000

The pool: `--endpoints` aggregated generation sims (least-loaded routing), each with a capacity of
`--capacity` slots in the gateway's admission (C = endpoints × capacity), decoding a token every
1/`--decode-rate` s. Every request, interactive or batch item, asks for `--tokens` tokens. One
gateway process, on SQLite (the database `make run` uses; `--database-url` for another).

Phases (`--phases`, in this order):

    download     (a) a batch of `--download-items` items, created through the API by a gateway
                 whose runner is off, its items then given a succeeded result (a ~600-byte Message)
                 directly in the database (running them is not what is measured); a fresh gateway
                 serves `GET .../results`: time to the first byte, the whole download, and the
                 gateway's RSS growth over its RSS before the request (sampled every 20 ms).
    sdk          (c) the baseline (then ADMISSION_ACTIVE_FLOW_S + 1 s idle, so that the batch
                 finds the cluster idle: see `main`): `--items` non-streamed `/v1/messages` requests of the same
                 bodies, sent by a client keeping C in flight (an SDK script at the pool's
                 concurrency), on an idle cluster: the wall time.
    batch        (c) the same items as one batch, on an idle cluster: the time from create to
                 `ended` (polled every 0.2 s), and the pool's busy share while the batch had
                 waiting items (the sims' active requests / C, sampled every 0.1 s).
    solo         (b) the interactive key alone: `--interactive-rate` streamed requests per second
                 (Poisson) for `--window` s; time to first token at the client (the first
                 content_block_delta) p50/p99.
    beside       (b) the same interactive load while a batch of `--beside-items` items runs
                 (canceled after the window): the interactive p99 over solo's, and the pool's busy
                 share while the batch had waiting items.

The machine this runs on is shared (2 cores, other work running): the results record the load
average, and the figures are this machine's, not the design's limits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import harness as h
import httpx

POOL = "bench-batches"
ACTIVE_FLOW_S = 10.0  # the gateway's ADMISSION_ACTIVE_FLOW_S default
SETUP = """
import json
from messages_api.auth import create_api_key
from workers.models import WorkerEndpoint, WorkerPool
pool = WorkerPool.objects.create(name={pool!r}, model={model!r}, schedule_style="aggregated", routing="least_loaded",
                                 max_local_prefill_tokens=0)
for url in {urls!r}:
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=url, capacity={capacity})
keys = {{}}
for name in ("interactive", "batcher"):
    row, secret = create_api_key(name)
    keys[name] = secret
print(json.dumps(keys))
"""
# A succeeded result of a realistic size (a short answer's Message), for the download phase.
RESULT = json.dumps({
    "type": "succeeded",
    "message": {
        "id": "msg_0123456789abcdef01234567", "type": "message", "role": "assistant", "model": h.MODEL,
        "content": [{"type": "text", "text": "word " * 80}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 80, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    },
}, separators=(",", ":"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="download,sdk,batch,solo,beside")
    parser.add_argument("--endpoints", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=4, help="slots per endpoint")
    parser.add_argument("--decode-rate", type=float, default=100.0, help="sim tokens per second per request")
    parser.add_argument("--tokens", type=int, default=10, help="tokens per answer")
    parser.add_argument("--items", type=int, default=1500, help="items of the batch and the SDK script (c)")
    parser.add_argument("--download-items", type=int, default=100_000)
    parser.add_argument("--interactive-rate", type=float, default=3.0, help="interactive requests per second (b)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of interactive load per phase (b)")
    parser.add_argument("--beside-items", type=int, default=5000)
    parser.add_argument("--gateway-setting", action="append", default=[], metavar="NAME=VALUE", help="a setting of the measured gateway")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="batches")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.items, args.download_items, args.window, args.beside_items = 200, 5000, 5.0, 1000
    args.phases = args.phases.split(",")
    args.slots = args.endpoints * args.capacity
    return args


def item_body(n: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"model": h.MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": f"item {n} [sim tokens={args.tokens}]"}]}


def headers(key: str) -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": h.ANTHROPIC_VERSION, "content-type": "application/json"}


class Database:
    """Reads (and the download phase's writes) straight to the bench's SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=60)

    def queued(self, conn: sqlite3.Connection, batch_id: str) -> int:
        row = conn.execute(
            "SELECT count(*) FROM messages_api_batchitem i JOIN messages_api_messagebatch b ON i.batch_id = b.id "
            "WHERE b.batch_id = ? AND i.state = 'queued'", (batch_id,),
        ).fetchone()
        return int(row[0])

    def finish_all(self, batch_id: str) -> None:
        conn = self.connect()
        try:
            with conn:
                (pk,) = conn.execute("SELECT id FROM messages_api_messagebatch WHERE batch_id = ?", (batch_id,)).fetchone()
                n = conn.execute(
                    "UPDATE messages_api_batchitem SET state = 'done', result_type = 'succeeded', result = ?, "
                    "finished_at = CURRENT_TIMESTAMP WHERE batch_id = ?", (RESULT, pk),
                ).rowcount
                conn.execute(
                    "UPDATE messages_api_messagebatch SET processing_status = 'ended', ended_at = CURRENT_TIMESTAMP, "
                    "succeeded = ? WHERE id = ?", (n, pk),
                )
        finally:
            conn.close()


class BusySampler:
    """The pool's active requests (the sims' own count) every 0.1 s, and whether the batch had
    waiting items then: the pool's busy share while it had."""

    def __init__(self, sims: list[h.SimProc], slots: int, db: Database) -> None:
        self.sims, self.slots, self.db = sims, slots, db
        self.batch_id: str | None = None
        self.samples: list[tuple[float, int, int]] = []  # (time, active, queued)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        conn = self.db.connect()
        try:
            while not self._stop.wait(0.1):
                active = sum(h.sim_stats(sim.url)["active"] for sim in self.sims)
                queued = self.db.queued(conn, self.batch_id) if self.batch_id else 0
                self.samples.append((time.monotonic(), active, queued))
        finally:
            conn.close()

    def busy_share(self) -> dict[str, Any]:
        waiting = [min(active, self.slots) / self.slots for _, active, queued in self.samples if queued > 0]
        return {"samples_with_waiting_items": len(waiting), "busy_share": sum(waiting) / len(waiting) if waiting else None}


async def create_batch(client: httpx.AsyncClient, key: str, n: int, args: argparse.Namespace) -> tuple[str, float]:
    body = json.dumps({"requests": [{"custom_id": f"i{i}", "params": item_body(i, args)} for i in range(n)]}, separators=(",", ":"))
    started = time.perf_counter()
    resp = await client.post("/v1/messages/batches", content=body, headers=headers(key), timeout=600)
    resp.raise_for_status()
    return resp.json()["id"], time.perf_counter() - started


async def wait_ended(client: httpx.AsyncClient, key: str, batch_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = (await client.get(f"/v1/messages/batches/{batch_id}", headers=headers(key))).json()
        if batch["processing_status"] == "ended":
            return dict(batch)
        await asyncio.sleep(0.2)
    raise RuntimeError(f"batch {batch_id} did not end in {timeout:.0f} s")


# --- (a) download ---------------------------------------------------------------------------------


def phase_download(stack: h.Stack, args: argparse.Namespace, keys: dict[str, str], db: Database) -> dict[str, Any]:
    creator = stack.start_gateway({"BATCH_RUNNER_ENABLED": "0", "BATCH_MAX_BYTES": str(256 * 1024 * 1024)})

    async def create() -> tuple[str, float]:
        async with httpx.AsyncClient(base_url=creator.url) as client:
            return await create_batch(client, keys["batcher"], args.download_items, args)

    batch_id, create_s = asyncio.run(create())
    creator.stop()
    stack.procs.remove(creator)
    db.finish_all(batch_id)
    gateway = stack.start_gateway({"BATCH_RUNNER_ENABLED": "0"})
    with httpx.Client(base_url=gateway.url, timeout=600) as client:
        client.get(f"/v1/messages/batches/{batch_id}", headers=headers(keys["batcher"])).raise_for_status()  # warm
        time.sleep(1.0)
        rss_before = h.rss_mib(gateway.pid)
        peak = [rss_before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.02):
                peak[0] = max(peak[0], h.rss_mib(gateway.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        first_byte: float | None = None
        size = lines = 0
        with client.stream("GET", f"/v1/messages/batches/{batch_id}/results", headers=headers(keys["batcher"])) as resp:
            resp.raise_for_status()
            for chunk in resp.iter_bytes():
                if first_byte is None:
                    first_byte = time.perf_counter() - started
                size += len(chunk)
                lines += chunk.count(b"\n")
        total = time.perf_counter() - started
        stop.set()
        sampler.join()
    gateway.stop()
    stack.procs.remove(gateway)
    out = {
        "items": args.download_items, "create_s": create_s, "first_byte_ms": (first_byte or 0) * 1000, "download_s": total,
        "bytes": size, "lines": lines, "rss_before_mib": rss_before, "rss_peak_mib": peak[0], "rss_growth_mib": peak[0] - rss_before,
    }
    print(f"(a) download: {lines} lines, {size / 2**20:.1f} MiB in {total:.2f} s, first byte {out['first_byte_ms']:.1f} ms, "
          f"RSS {rss_before:.1f} → peak {peak[0]:.1f} MiB (growth {out['rss_growth_mib']:.1f} MiB; target ≤ 64)")
    return out


# --- (c) the SDK script and the batch ---------------------------------------------------------------


async def sdk_script(port: int, key: str, args: argparse.Namespace) -> dict[str, Any]:
    """`--items` requests, C in flight at once, each on a kept-alive connection of its lane."""
    queue = list(range(args.items))
    statuses: dict[int, int] = {}

    async def lane() -> None:
        conn = h.KeepAlive(port)
        try:
            while queue:
                n = queue.pop()
                body = json.dumps(item_body(n, args), separators=(",", ":")).encode()
                resp = await conn.request(h.gateway_request(port, key, body))
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
        finally:
            conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(args.slots)))
    return {"items": args.items, "concurrency": args.slots, "seconds": time.perf_counter() - started, "statuses": statuses}


def phase_batch(gateway: h.GatewayProc, sims: list[h.SimProc], args: argparse.Namespace, keys: dict[str, str], db: Database) -> dict[str, Any]:
    async def run(sampler: BusySampler) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            started = time.perf_counter()
            batch_id, create_s = await create_batch(client, keys["batcher"], args.items, args)
            sampler.batch_id = batch_id
            done = await wait_ended(client, keys["batcher"], batch_id, timeout=args.items * 2.0)
            return {"batch_id": batch_id, "create_s": create_s, "seconds": time.perf_counter() - started, "request_counts": done["request_counts"]}

    with BusySampler(sims, args.slots, db) as sampler:
        out = asyncio.run(run(sampler))
    out |= sampler.busy_share()
    return out


# --- (b) interactive beside a batch -----------------------------------------------------------------


async def interactive(port: int, key: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ttft: list[float] = []
    errors: dict[str, int] = {}

    async def one(n: int) -> None:
        body = h.messages_body(f"[sim tokens={args.tokens}]", stream=True, text=f"interactive {n}", max_tokens=64)
        conn = await h.connect(port)
        try:
            resp = await conn.request(h.gateway_request(port, key, body), count=b"content_block_delta")
        finally:
            conn.close()
        if resp.status == 200 and resp.first_count_at is not None:
            ttft.append(resp.first_count_at - resp.sent_at)
        else:
            label = f"{resp.status} {resp.error or ''}".strip()
            errors[label] = errors.get(label, 0) + 1

    tasks = []
    end = time.monotonic() + args.window
    n = 0
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(one(n)))
        n += 1
        await asyncio.sleep(rng.expovariate(args.interactive_rate))
    await asyncio.gather(*tasks)
    ttft.sort()
    return {"sent": n, "ttft_ms": h.in_ms(h.distribution(ttft)), "errors": errors}


def phase_solo(gateway: h.GatewayProc, args: argparse.Namespace, keys: dict[str, str]) -> dict[str, Any]:
    return asyncio.run(interactive(gateway.port, keys["interactive"], args, seed=1))


def phase_beside(gateway: h.GatewayProc, sims: list[h.SimProc], args: argparse.Namespace, keys: dict[str, str], db: Database) -> dict[str, Any]:
    async def run(sampler: BusySampler) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            batch_id, _ = await create_batch(client, keys["batcher"], args.beside_items, args)
            sampler.batch_id = batch_id
            await asyncio.sleep(2.0)  # the batch's claims under way before the window opens
            result = await interactive(gateway.port, keys["interactive"], args, seed=1)
            batch = (await client.post(f"/v1/messages/batches/{batch_id}/cancel", headers=headers(keys["batcher"]))).json()
            result["batch_counts_at_cancel"] = batch["request_counts"]
            await wait_ended(client, keys["batcher"], batch_id, timeout=120)
            return result

    with BusySampler(sims, args.slots, db) as sampler:
        out = asyncio.run(run(sampler))
    out |= sampler.busy_share()
    return out


def main() -> None:
    args = parse_args()
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "quick"}}
    started = time.monotonic()
    with h.Stack("batches", database_url=args.database_url, keep=args.keep) as stack:
        stack.migrate()
        db = Database(stack.tmp / "gateway.sqlite3")
        sims = [stack.start_simworker("generation", tokens_per_second=args.decode_rate, max_context_tokens=262144) for _ in range(args.endpoints)]
        keys = json.loads(stack.manage("shell", "-c", SETUP.format(pool=POOL, model=h.MODEL, urls=[s.url for s in sims],
                                                                   capacity=args.capacity)).strip().splitlines()[-1])
        results["loadavg_before"] = list(__import__("os").getloadavg())
        if "download" in args.phases:
            results["download"] = phase_download(stack, args, keys, db)
        gateway = stack.start_gateway({"BATCH_POLL_INTERVAL_S": "0.2", **dict(item.split("=", 1) for item in args.gateway_setting)})
        # One request first: the pool is loaded and the connections to it are warm.
        asyncio.run(sdk_script(gateway.port, keys["interactive"], argparse.Namespace(**{**vars(args), "items": args.slots})))
        if "sdk" in args.phases:
            results["sdk"] = asyncio.run(sdk_script(gateway.port, keys["interactive"], args))
            print(f"(c) SDK script: {args.items} items at concurrency {args.slots} in {results['sdk']['seconds']:.2f} s {results['sdk']['statuses']}")
        if "batch" in args.phases:
            if "sdk" in results:
                # An idle cluster: the SDK script's key counts as active in the admission's headroom
                # for ADMISSION_ACTIVE_FLOW_S after its last request, and a batch item (a lower
                # class) must leave slots free for it meanwhile.
                time.sleep(ACTIVE_FLOW_S + 1.0)
            results["batch"] = phase_batch(gateway, sims, args, keys, db)
            b = results["batch"]
            print(f"(c) batch: {args.items} items in {b['seconds']:.2f} s {b['request_counts']}; pool busy {b['busy_share']} "
                  f"while items waited ({b['samples_with_waiting_items']} samples)")
            if "sdk" in results:
                results["batch_over_sdk"] = b["seconds"] / results["sdk"]["seconds"]
                print(f"    batch / SDK script: {results['batch_over_sdk']:.3f} (target ≤ 1.1)")
        if "solo" in args.phases:
            results["solo"] = phase_solo(gateway, args, keys)
            print(f"(b) solo: interactive TTFT {results['solo']['ttft_ms']} errors {results['solo']['errors']}")
        if "beside" in args.phases:
            results["beside"] = phase_beside(gateway, sims, args, keys, db)
            b = results["beside"]
            print(f"(b) beside a batch: interactive TTFT {b['ttft_ms']} errors {b['errors']}; pool busy {b['busy_share']}")
            if "solo" in results:
                results["p99_over_solo"] = b["ttft_ms"]["p99"] / results["solo"]["ttft_ms"]["p99"]
                print(f"    p99 / solo p99: {results['p99_over_solo']:.3f} (target ≤ 1.1)")
        results["loadavg_after"] = list(__import__("os").getloadavg())
    results["wall_s"] = time.monotonic() - started
    h.write_result(args.name, results)


if __name__ == "__main__":
    main()
