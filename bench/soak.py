"""Soak: N concurrent streams for T minutes with random worker faults and client disconnects,
then the invariants a long-running gateway must hold.

    .venv/bin/python bench/soak.py                           # 200 streams, 10 min, SQLite
    .venv/bin/python bench/soak.py --streams 50 --minutes 1  # a short proof run
    .venv/bin/python bench/soak.py --database-url postgres://user:pw@127.0.0.1/soak

The world: a sim context + generation pair (pool `soak-sim-*`) and tests/support/badworker.py registered
as both roles of a second pool (`soak-bad-*`, its own model). Each of the N client loops sends
one request after another, each a random scenario:
- healthy streams (`[sim tokens=K]`), and one in ten non-streamed;
- the sim's faults: fast and late context errors, generation errors, deaths mid-stream
  (`gen_fail_after`), a slow first token (`gen_delay`);
- the bad worker's malformed chunks, error frames, drops, trickles and idle streams;
- client disconnects: a long stream or a long context phase, the client hanging up (RST) after
  its first event or ping.
While it runs the gateway's RSS is sampled every --rss-interval s.

At the end (after in-flight requests finished and --settle s) it checks:
- no audit row still `in_progress`;
- every reservation released (`released_at` set) — and, when /metrics exports it, the gateway's
  duplicate-release counter at 0 ("released exactly once");
- workers idle: the sims' /sim/stats `active` 0 and `kv_held` 0, the bad worker's `active` 0;
- every request the client abandoned recorded `cancelled`;
- no broken answer of the bad worker relayed as a success (`message_stop`);
- no malformed SSE frame, no stream that ended without `message_stop` or `error`, no answer
  outside Anthropic's envelope, no request without an end within its deadline (hung);
- RSS growth between the end of the warm-up and the end (target < 5 %).
Prints a summary and writes bench/results/soak.json (`--name` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h11  # noqa: E402
import harness as h  # noqa: E402  (puts the project on the path)

from tests.support.badworker import start_badworker  # noqa: E402
from tests.support.rawclient import parse_frame  # noqa: E402

RSS_GROWTH_TARGET_PCT = 5.0

# Short enough that a fault ends quickly, long enough that healthy streams never hit them.
GATEWAY_ENV = {
    "WORKER_CONTEXT_TIMEOUT_S": "10",
    "WORKER_FIRST_BYTE_TIMEOUT_S": "10",
    "WORKER_IDLE_TIMEOUT_S": "3",
    "MESSAGES_REQUEST_DEADLINE_S": "60",
    "WORKER_MAX_SSE_LINE_BYTES": str(1024 * 1024),
    "WORKER_MAX_JSON_BYTES": str(8 * 1024 * 1024),
    "WORKER_MAX_RESPONSE_HEADERS": "100",
    "WORKER_MAX_RESPONSE_HEADER_BYTES": str(64 * 1024),
    "MESSAGES_BODY_READ_TIMEOUT_S": "10",
    "MESSAGES_PING_INTERVAL_S": "2",
    "MESSAGES_STREAM_START_WAIT_S": "0.5",
    "AUDIT_FLUSH_INTERVAL_S": "0.2",
    "REGISTRY_REFRESH_INTERVAL_S": "1",
    "WORKER_HANDOFF_RELEASE_TIMEOUT_S": "3",
    # The soak is about invariants under faults, not about breakers: the injected 5xx must not
    # take the pools offline (a breaker answering 529 for 30 s would hide every other path).
    "BREAKER_FAILURE_THRESHOLD": "1000000000",
}
CLIENT_TIMEOUT_S = 60 + 30  # the request deadline plus a margin: longer is a hang

BAD_MODES = [
    "choices_null_item", "array_chunk", "choices_string", "number_chunk", "usage_number", "usage_tokens_string",
    "tool_args_object", "delta_null", "content_number", "content_object", "not_sse", "error_frame",
    "drop_mid_stream", "trickle_sse", "idle_mid_stream", "context_oops", "context_error_body", "context_drop",
    "error_body", "context_not_json",
]


@dataclass(frozen=True)
class Scenario:
    name: str
    pool: str  # "sim" or "bad"
    text: str
    stream: bool = True
    disconnect: str = ""  # "", "after_first_event" or "during_context"


def pick_scenario(rng: random.Random, disconnect_rate: float, fault_rate: float) -> Scenario:
    roll = rng.random()
    if roll < disconnect_rate:
        if rng.random() < 0.5:
            return Scenario("disconnect_mid_stream", "sim", "long [sim tokens=400]", disconnect="after_first_event")
        return Scenario("disconnect_in_context", "sim", "wait [sim context_delay=4 tokens=5]", disconnect="during_context")
    if roll < disconnect_rate + fault_rate:
        kind = rng.choice(["sim", "sim", "bad", "bad", "bad"])
        if kind == "bad":
            mode = rng.choice(BAD_MODES)
            return Scenario(f"bad:{mode}", "bad", f"[bad mode={mode}]", stream=rng.random() < 0.8)
        fault, directive = rng.choice(
            [
                ("sim:context_fast_error", "context_status=500"),
                ("sim:context_late_error", "context_delay=2 context_status=503"),
                ("sim:generation_error", "gen_status=500"),
                ("sim:death_mid_stream", f"gen_fail_after={rng.randint(1, 20)} tokens=40"),
                ("sim:slow_first_token", f"gen_delay={rng.uniform(0.5, 3):.1f} tokens=10"),
            ]
        )
        return Scenario(fault, "sim", f"fault [sim {directive}]", stream=rng.random() < 0.8)
    return Scenario("ok", "sim", f"hello [sim tokens={rng.randint(5, 60)}]", stream=rng.random() < 0.9)


@dataclass
class Result:
    scenario: str
    request_id: str = ""
    status: int | None = None
    end: str = ""  # message_stop, error_event, http_error, truncated, hung, disconnected, connect_error
    error_type: str = ""
    malformed_frames: list[str] = field(default_factory=list)
    non_envelope: str = ""
    seconds: float = 0.0


class Client:
    """One request on a fresh connection; h11 for the framing, SSE frames parsed here."""

    def __init__(self, port: int, key: str) -> None:
        self.port = port
        self.key = key

    async def run(self, scenario: Scenario, model: str, rng: random.Random) -> Result:
        result = Result(scenario.name)
        started = time.monotonic()
        body = json.dumps(
            {"model": model, "max_tokens": 1024, "stream": scenario.stream, "messages": [{"role": "user", "content": scenario.text}]}
        ).encode()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError as exc:
            result.end, result.non_envelope = "connect_error", str(exc)
            return result
        conn = h11.Connection(h11.CLIENT)
        headers = [
            ("host", f"127.0.0.1:{self.port}"), ("x-api-key", self.key), ("anthropic-version", "2023-06-01"),
            ("content-type", "application/json"), ("content-length", str(len(body))), ("connection", "close"),
        ]
        writer.write(
            conn.send(h11.Request(method="POST", target="/v1/messages", headers=headers))
            + conn.send(h11.Data(data=body))
            + conn.send(h11.EndOfMessage())
        )
        disconnect_at: float | None = None
        if scenario.disconnect == "during_context":
            disconnect_at = started + rng.uniform(1.0, 2.5)  # the context phase takes 4 s
        buffer, payload = b"", bytearray()
        events: list[str] = []
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        wait = None if disconnect_at is None else max(0.0, disconnect_at - time.monotonic())
                        try:
                            data = await asyncio.wait_for(reader.read(65536), wait) if wait is not None else await reader.read(65536)
                        except TimeoutError:
                            if events and events[-1] in ("message_stop", "error"):
                                break
                            result.end = "disconnected"
                            break
                        conn.receive_data(data)
                        continue
                    if isinstance(event, h11.Response):
                        result.status = event.status_code
                        result.request_id = dict(event.headers).get(b"request-id", b"").decode()
                    elif isinstance(event, h11.Data):
                        if result.status == 200 and scenario.stream:
                            buffer += bytes(event.data)
                            while b"\n\n" in buffer:
                                raw, buffer = buffer.split(b"\n\n", 1)
                                name = _frame(raw, result)
                                if name:
                                    events.append(name)
                                    if scenario.disconnect == "after_first_event" and disconnect_at is None and name == "content_block_delta":
                                        disconnect_at = time.monotonic() + rng.uniform(0.05, 1.0)
                        else:
                            payload += bytes(event.data)
                    elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                        break
        except TimeoutError:
            result.end = "hung"
        except (h11.RemoteProtocolError, ConnectionError) as exc:
            result.end = result.end or "truncated"
            result.non_envelope = f"{type(exc).__name__}: {exc}"
        finally:
            if result.end == "disconnected":
                writer.transport.abort()  # RST, as a client that gave up
            else:
                writer.close()
        result.seconds = time.monotonic() - started
        if result.end:
            return result
        if result.status == 200 and scenario.stream:
            if events and events[-1] == "message_stop":
                result.end = "message_stop"
            elif events and events[-1] == "error":
                result.end = "error_event"
            else:
                result.end = "truncated"
            return result
        try:
            answer = json.loads(payload)
        except ValueError:
            result.end, result.non_envelope = "http_error" if result.status != 200 else "truncated", payload[:200].decode("latin-1")
            return result
        if result.status == 200:
            result.end = "message_stop" if isinstance(answer, dict) and answer.get("type") == "message" else "truncated"
        else:
            result.end = "http_error"
            if _envelope(answer):
                result.error_type = answer["error"]["type"]
            else:
                result.non_envelope = json.dumps(answer)[:200]
        return result


def _envelope(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and body.get("type") == "error"
        and isinstance(body.get("error"), dict)
        and isinstance(body["error"].get("type"), str)
        and isinstance(body["error"].get("message"), str)
    )


_DELTA_FIELD = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking", "signature_delta": "signature"}


def _frame(raw: bytes, result: Result) -> str:
    """The frame's event name ("" for a comment); a malformed frame is recorded on `result`."""
    try:
        parsed = parse_frame(raw)
    except ValueError:
        result.malformed_frames.append(raw[:200].decode("latin-1"))
        return "malformed"
    if parsed is None:
        return ""
    event, data = parsed
    if not isinstance(data, dict) or data.get("type") != event:
        result.malformed_frames.append(raw[:200].decode("latin-1"))
        return "malformed"
    delta = data.get("delta") if event == "content_block_delta" else None
    if isinstance(delta, dict) and not isinstance(delta.get(_DELTA_FIELD.get(str(delta.get("type")), "type")), str):
        result.malformed_frames.append(raw[:200].decode("latin-1"))  # e.g. a text_delta whose text is a number
        return "malformed"
    if event == "error":
        if not _envelope(data):
            result.malformed_frames.append(raw[:200].decode("latin-1"))
        else:
            result.error_type = data["error"]["type"]
    return event


class RssSampler(threading.Thread):
    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.samples.append((time.monotonic() - self.started_at, h.rss_mib(self.pid)))
            except OSError:
                return
            self.stopped.wait(self.interval)


def rss_growth(samples: list[tuple[float, float]], warmup_s: float) -> dict[str, Any]:
    """Median RSS over the first 10 % after the warm-up vs the last 10 % of the run."""
    after = [rss for at, rss in samples if at >= warmup_s]
    if len(after) < 4:
        return {"samples": len(samples), "growth_pct": None}
    n = max(2, len(after) // 10)
    start, end = statistics.median(after[:n]), statistics.median(after[-n:])
    return {
        "samples": len(samples),
        "warmup_end_mib": start,
        "end_mib": end,
        "max_mib": max(rss for _, rss in samples),
        "growth_mib": end - start,
        "growth_pct": (end - start) / start * 100,
    }


async def load(args: argparse.Namespace, port: int, key: str, models: dict[str, str]) -> list[Result]:
    client = Client(port, key)
    results: list[Result] = []
    stop_at = time.monotonic() + args.minutes * 60
    master = random.Random(args.seed)

    async def user(n: int) -> None:
        rng = random.Random(master.random() + n)
        await asyncio.sleep(rng.uniform(0, min(5.0, args.minutes * 6)))  # spread the starts
        while time.monotonic() < stop_at:
            scenario = pick_scenario(rng, args.disconnect_rate, args.fault_rate)
            results.append(await client.run(scenario, models[scenario.pool], rng))

    async def progress() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(min(30.0, args.minutes * 15))
            ends = Counter(r.end for r in results)
            print(f"  {time.strftime('%H:%M:%S')} {len(results)} requests done: {dict(ends)}", flush=True)

    reporter = asyncio.create_task(progress())
    await asyncio.gather(*(user(n) for n in range(args.streams)))
    reporter.cancel()
    return results


QUERY = """
import json, sys
from messages_api.models import MessageRequest as M
from workers.models import Reservation as R
models = {models!r}
pools = {pools!r}
ids = json.load(open({ids_path!r}))
rows = M.objects.filter(model__in=models)
print(json.dumps({{
    "by_status": {{s: rows.filter(status=s).count() for s in ("in_progress", "completed", "failed", "cancelled", "rejected")}},
    "in_progress_ids": list(rows.filter(status="in_progress").values_list("request_id", flat=True)[:20]),
    "reservations": R.objects.filter(pool_name__in=pools).count(),
    "unreleased": R.objects.filter(pool_name__in=pools, released_at__isnull=True).count(),
    "unreleased_ids": list(R.objects.filter(pool_name__in=pools, released_at__isnull=True).values_list("request_id", flat=True)[:20]),
    "disconnected_status": dict((rid, st) for rid, st in M.objects.filter(request_id__in=ids).values_list("request_id", "status")),
}}))
"""


def duplicate_releases(port: int) -> float | None:
    """The gateway's duplicate-release counter from /metrics, if it exports one."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode(errors="replace")
    except OSError:
        return None
    finally:
        conn.close()
    values = [float(m.group(1)) for m in re.finditer(r"^\w*duplicate_release\w*(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)]
    return sum(values) if values else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, help="concurrent client loops (default 200; --quick 20)")
    parser.add_argument("--minutes", type=float, help="load duration (default 10; --quick 0.5)")
    parser.add_argument("--warmup", type=float, help="seconds excluded from the RSS growth (default 120; --quick 10)")
    parser.add_argument("--fault-rate", type=float, default=0.25, help="share of requests with a worker fault (default 0.25)")
    parser.add_argument("--disconnect-rate", type=float, default=0.1, help="share of requests the client abandons (default 0.1)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the load before the invariants are read")
    parser.add_argument("--rss-interval", type=float, default=2.0, help="RSS sampling period, seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tokens-per-second", type=float, default=100.0, help="sim decode speed (default 100)")
    parser.add_argument("--database-url", help="default: a new SQLite file in a temporary directory")
    args = h.parse_args(parser, quick={"streams": 20, "minutes": 0.5, "warmup": 10.0}, full={"streams": 200, "minutes": 10.0, "warmup": 120.0})
    return args


def main() -> None:
    args = parse_args()
    h.raise_nofile()
    run_id = time.strftime("%Y%m%d%H%M%S")
    database = "postgresql" if args.database_url and args.database_url.startswith("postgres") else "sqlite"
    if database == "postgresql":
        from nonstream_rps import ensure_postgres_database

        ensure_postgres_database(args.database_url)
    pools = {"sim": f"soak-sim-{run_id}", "bad": f"soak-bad-{run_id}"}
    models = {"sim": f"soak-sim-model-{run_id}", "bad": f"soak-bad-model-{run_id}"}
    with h.Stack("soak", database_url=args.database_url, keep=args.keep) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=args.tokens_per_second, prefill_tokens_per_second=100000, kv_timeout=30)
        bad = start_badworker()
        try:
            for role, url in (("context", ctx.url), ("generation", gen.url)):
                stack.register_worker(pools["sim"], models["sim"], role, url, schedule_style="context_first")
                stack.register_worker(pools["bad"], models["bad"], role, bad.url, schedule_style="context_first")
            key = stack.create_api_key(f"soak-{run_id}")
            gateway = stack.start_gateway(GATEWAY_ENV, expect_pools=list(pools.values()))
            h.wait_for_quiet(args.quiet_wait)
            sampler = RssSampler(gateway.pid, args.rss_interval)
            sampler.start()
            print(f"soak: {args.streams} concurrent clients for {args.minutes} min ({database}); gateway pid {gateway.pid}", flush=True)
            started = time.monotonic()
            results = asyncio.run(load(args, gateway.port, key, models))
            load_s = time.monotonic() - started
            sampler.stopped.set()
            sampler.join()
            time.sleep(args.settle)
            alive = gateway.process.poll() is None
            duplicates = duplicate_releases(gateway.port) if alive else None
            sims = {"context": h.sim_stats(ctx.url), "generation": h.sim_stats(gen.url)}
            bad_stats = bad.stats()
            disconnected = [r.request_id for r in results if r.end == "disconnected" and r.request_id]
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as ids_file:
                json.dump(disconnected, ids_file)
            db = json.loads(
                stack.manage("shell", "-c", QUERY.format(models=list(models.values()), pools=list(pools.values()), ids_path=ids_file.name))
                .strip()
                .splitlines()[-1]
            )
            Path(ids_file.name).unlink()
        finally:
            bad.stop()
    report(args, database, results, load_s, sampler, db, sims, bad_stats, duplicates, disconnected, alive)


def report(
    args: argparse.Namespace, database: str, results: list[Result], load_s: float, sampler: RssSampler, db: dict[str, Any],
    sims: dict[str, Any], bad_stats: dict[str, Any], duplicates: float | None, disconnected: list[str], alive: bool,
) -> None:
    ends = Counter(r.end for r in results)
    by_scenario: dict[str, Counter[str]] = {}
    for r in results:
        by_scenario.setdefault(r.scenario, Counter())[r.end] += 1
    malformed = [f for r in results for f in r.malformed_frames]
    non_envelope = [r for r in results if r.non_envelope and r.end == "http_error"]
    not_cancelled = {rid: st for rid, st in db["disconnected_status"].items() if st != "cancelled"}
    missing_rows = [rid for rid in disconnected if rid not in db["disconnected_status"]]
    growth = rss_growth(sampler.samples, args.warmup)
    # Every bad-worker answer is broken: one that reached the client as a success was trusted.
    trusted = Counter(r.scenario for r in results if r.scenario.startswith("bad:") and r.end == "message_stop")
    checks = {
        "gateway alive": (alive, "yes" if alive else "NO: the gateway process died"),
        "no in_progress audit row": (db["by_status"]["in_progress"] == 0, f"{db['by_status']['in_progress']} {db['in_progress_ids'][:5]}"),
        "every reservation released": (db["unreleased"] == 0, f"{db['unreleased']} of {db['reservations']} open {db['unreleased_ids'][:5]}"),
        "released exactly once": (
            duplicates in (None, 0),
            "not exported by /metrics" if duplicates is None else f"duplicate releases: {duplicates:g}",
        ),
        "sim workers idle": (
            all(s["active"] == 0 and s.get("kv_held", 0) == 0 for s in sims.values()),
            "; ".join(f"{role} active={s['active']} kv_held={s.get('kv_held')}" for role, s in sims.items()),
        ),
        "bad worker idle": (bad_stats["active"] == 0, f"active={bad_stats['active']}"),
        "each disconnect cancelled": (
            not not_cancelled and not missing_rows,
            f"{len(disconnected)} disconnects, not cancelled: {dict(Counter(not_cancelled.values()))}, no row: {len(missing_rows)}",
        ),
        "no hung request": (ends.get("hung", 0) == 0, f"{ends.get('hung', 0)} (no end within {CLIENT_TIMEOUT_S} s)"),
        "no stream ended without message_stop/error": (ends.get("truncated", 0) == 0, str(ends.get("truncated", 0))),
        "no malformed SSE frame": (not malformed, f"{len(malformed)} {malformed[:2]}"),
        "no broken worker answer passed as success": (not trusted, f"{sum(trusted.values())} {dict(trusted)}"),
        "no answer outside the envelope": (not non_envelope, f"{len(non_envelope)} {[r.non_envelope for r in non_envelope[:2]]}"),
        "RSS growth after warm-up < 5 %": (
            growth["growth_pct"] is not None and growth["growth_pct"] < RSS_GROWTH_TARGET_PCT,
            "too few samples"
            if growth["growth_pct"] is None
            else f"{growth['warmup_end_mib']:.1f} → {growth['end_mib']:.1f} MiB ({growth['growth_pct']:+.1f} %), max {growth['max_mib']:.1f}",
        ),
    }
    print(f"\nsoak: {len(results)} requests in {load_s:.0f} s by {args.streams} clients ({database}); ends: {dict(ends)}")
    h.print_table(
        "per scenario", ["scenario", "n", "ends"],
        [[name, sum(c.values()), ", ".join(f"{k} {v}" for k, v in c.most_common())] for name, c in sorted(by_scenario.items())],
    )
    print(f"audit rows: {db['by_status']}; reservations: {db['reservations']}")
    h.print_table("invariants", ["check", "ok", "detail"], [[name, h.verdict(ok), detail] for name, (ok, detail) in checks.items()])
    violations = [name for name, (ok, _) in checks.items() if not ok]
    print(f"\nverdict: {h.verdict(not violations)}" + (f" ({len(violations)} violated: {', '.join(violations)})" if violations else ""))
    name = h.result_name(args, "soak") + ("-pg" if database == "postgresql" else "")
    h.write_result(
        name,
        {
            "config": {
                "streams": args.streams, "minutes": args.minutes, "warmup_s": args.warmup, "fault_rate": args.fault_rate,
                "disconnect_rate": args.disconnect_rate, "settle_s": args.settle, "seed": args.seed, "database": database,
                "gateway_env": GATEWAY_ENV,
            },
            "requests": len(results),
            "load_s": load_s,
            "ends": dict(ends),
            "by_scenario": {k: dict(v) for k, v in by_scenario.items()},
            "audit": db,
            "sims": sims,
            "bad_worker": bad_stats,
            "duplicate_releases": duplicates,
            "rss": {**growth, "series": sampler.samples},
            "malformed_frames": malformed[:20],
            "checks": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in checks.items()},
            "violations": violations,
            "ok": not violations,
        },
    )


if __name__ == "__main__":
    main()
