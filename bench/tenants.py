#!/usr/bin/env python
"""Many tenants on one pool: a key flooding at 10× the pool's capacity next to well-behaved keys,
without admission control and with it; then two gateway processes sharing a Redis that is
stopped mid-run; and the admission path's CPU per request, in-process.

    .venv/bin/python bench/tenants.py            # every phase (~5 min)
    .venv/bin/python bench/tenants.py --quick    # a smoke test (~1.5 min: a 2× flood, 4 s windows)
    .venv/bin/python bench/tenants.py --phases solo,quiet,limited --equal-share 0.5 --name tenants-share0.5

The pool: `--endpoints` generation sims (aggregated schedule, least-loaded routing), each behind
a counting proxy (bench/harness/counting_proxy.py) that is also the engine's batch limit: an
endpoint runs at most `--capacity` requests at once and queues the rest first come, first served
in front of the worker, as an engine's scheduler does. Sims decode a token every 1/`--decode-rate`
s and prefill at `--prefill-rate` tokens/s, each request independently (`--prefill-concurrency`
0: one request's prefill does not delay another's). The proxy counts every request from its
arrival to its response's end, per endpoint and per tenant, and keeps each maximum, and the
arrivals that took a count over its bound (capacity; the noisy key's concurrency limit): the
check holds at every arrival through the run, not at sampled moments.

The keys (C = endpoints × capacity slots; a *share* is C / (equal keys + 2), the pool split
evenly among every key):

    eq1..eqN   "equal": open loop, each offering `--equal-share` shares of the pool (rate =
               shares / the request's service time): Poisson arrivals at the keys' total rate,
               dealt to the keys in turn (each key offers the same load); streamed, an
               `--equal-prompt`-word prompt and `--output-tokens` tokens of answer.
    noisy      the Claude Code request (tests/fixtures/claude_code_request.json, ~78 KB, ~20k
               prompt tokens, `--output-tokens` of answer, not streamed: an expired wait is then
               a 529 status with its headers), closed loop: `--noisy-factor` × C requests kept
               outstanding; after a 429 or 529 a client waits the answer's retry-after, as the
               SDKs and Claude Code do.
    batch      priority batch, closed loop of `--batch-concurrency` (default: one share) clients,
               the equal keys' requests, not streamed; retry-after honoured.

Phases (`--phases`, in this order; a fresh gateway for each):

    solo       each equal key alone, capacity set: its baseline
    quiet      capacity set, the equal keys and batch, no noisy key: what the well-behaved keys
               do to each other (the flood's own effect is a flood phase over this one)
    admission  (b) capacity set, the noisy key unlimited (the admission queue alone)
    limited    (b) capacity set, the noisy key limited to `--noisy-concurrency` requests at once
    fair       capacity set, the equal keys alone, each keeping `--fair-outstanding` × C / N
               streams outstanding (closed loop): the pool saturated by four equal keys, for
               Jain's index over what each was delivered
    open       (a) no admission control: no capacity, no limits (the engines' queues fill)
    cpu        the admission path's CPU per request, in a child process (see `micro_child`)
    redis      two gateway processes sharing a private redis-server (the bench starts it on a
               free port), the `limited` configuration plus `--noisy-rpm` requests per minute on
               the noisy key, clients spread over both gateways; Redis shut down half-way

In each flood phase the noisy and batch keys start first and the window opens `--warmup` s later
(the equal keys arrive from the start too, unmeasured until the window: `--no-equal-warm` keeps
them out of the warm-up, and the flood then has the pool to itself until they come);
the figures are the requests sent in the window (`--window` s), and the flood goes on until the
last of them is answered. Per key: requests sent, completed, 429, 529 (a status, by message: a
queue timeout, or "Overloaded" shed for event-loop lag; "529 in stream" if a stream's wait
outlived the stream start and ended in an overloaded_error event), 5xx other than 529 and other
errors (listed), time queued (the audit rows' queued_ms, 0 when not queued) p50/p99, time to
first token (streamed keys: first content_block_delta at the client; others: the audit's
first_token_ms) p50/p99 and p99 over the key's solo p99, output tokens delivered, and Jain's
index over the equal keys' tokens. Every 429 is checked for retry-after and anthropic-ratelimit-*
headers (not for a key whose only limit is its concurrency: no such header exists), every 529
for retry-after ≤ 59, every wait (queued_ms, and a 529's time at the client) against
ADMISSION_QUEUE_TIMEOUT_S (`--queue-timeout`) + 1 s. The proxy's per-tenant and
per-endpoint means over the window say how the slots were shared; the gateways' counters
(fallbacks by reason, before and after Redis stopped; admission refusals; requests shed) are
printed under each table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
from harness.limits import child_setup

from tests.support.ports import unused_port

FIXTURE = h.PROJECT_ROOT / "tests" / "fixtures" / "claude_code_request.json"
PROXY = h.PROJECT_ROOT / "bench" / "harness" / "counting_proxy.py"
POOL = "tenants"
MARKER = "zzTENANTzz"
PHASES = ("solo", "quiet", "admission", "limited", "fair", "open", "cpu", "redis")
DELTA = b"event: content_block_delta"
_RETRY_AFTER = re.compile(rb"\r\nretry-after: *([0-9.]+)", re.I)
_REQUEST_ID = re.compile(rb"\r\nrequest-id: *([^\r\n]+)", re.I)
_OUTPUT_TOKENS = re.compile(rb'"output_tokens": *([0-9]+)')
_ERROR_TYPE = re.compile(rb'"error": *\{[^}]*?"type": *"([a-z_]+)"')
_ERROR_MESSAGE = re.compile(rb'"message": *"([^"]*)"')


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of: " + ", ".join(PHASES))
    parser.add_argument("--endpoints", type=int, default=4, help="generation sims in the pool")
    parser.add_argument("--capacity", type=int, default=8, help="slots per endpoint (and the engine's batch limit)")
    parser.add_argument("--decode-rate", type=float, default=50.0, help="sim tokens per second per stream (50: one every 20 ms)")
    parser.add_argument("--prefill-rate", type=float, default=20000.0, help="sim prefill tokens per second")
    parser.add_argument("--prefill-concurrency", type=int, default=0, help="prefills a sim computes at once (0: unlimited)")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens per answer (every key)")
    parser.add_argument("--equal-keys", type=int, default=4)
    parser.add_argument("--equal-prompt", type=int, default=400, help="words (≈ tokens) in an equal key's prompt")
    parser.add_argument("--equal-share", type=float, default=1.0, help="what each equal key offers, in shares of the pool")
    parser.add_argument("--noisy-factor", type=float, help="the noisy key's outstanding requests, × C (default 10; --quick 2)")
    parser.add_argument("--noisy-concurrency", type=int, help="the noisy key's concurrency limit in `limited` and `redis` (default: one share)")
    parser.add_argument("--noisy-rpm", type=int, default=1200, help="the noisy key's requests per minute in `redis`")
    parser.add_argument("--batch-concurrency", type=int, help="the batch key's clients (default: one share)")
    parser.add_argument("--redis-stop", action=argparse.BooleanOptionalAction, default=True,
                        help="`redis`: stop Redis half-way through the window (default); --no-redis-stop keeps it up")
    parser.add_argument("--equal-warm", action=argparse.BooleanOptionalAction, default=True,
                        help="the equal keys arrive during the flood's warm-up too (default), so they are active when the window opens")
    parser.add_argument("--headroom", type=float, help="the gateways' ADMISSION_HEADROOM (default: theirs)")
    parser.add_argument("--gateway-setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every gateway (repeatable), e.g. ADMISSION_HEADROOM=0.25")
    parser.add_argument("--queue-timeout", type=float, help="the gateways' ADMISSION_QUEUE_TIMEOUT_S (default 5; --quick 3)")
    parser.add_argument("--fair-outstanding", type=float, default=1.5,
                        help="in `fair`, each equal key keeps this many × C / equal keys requests outstanding")
    parser.add_argument("--solo", type=float, help="seconds of each equal key's solo run (default 8; --quick 2)")
    parser.add_argument("--warmup", type=float, help="seconds the flood runs before the window opens (default 3; --quick 2)")
    parser.add_argument("--window", type=float, help="seconds of arrivals measured per flood phase (default 20; --quick 4)")
    parser.add_argument("--open-window", type=float, help="the window of the `open` phase, whose drain is long (default 10; --quick 3)")
    parser.add_argument("--fair-window", type=float, help="the window of the `fair` phase (default 10; --quick 3)")
    parser.add_argument("--drain-limit", type=float, default=90.0, help="most seconds to wait for the window's last answers")
    parser.add_argument("--micro-iterations", type=int, help="requests per case in `cpu` (default 20000; --quick 1500)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--micro-child", action="store_true", help=argparse.SUPPRESS)
    h.add_common_arguments(parser)
    args = parser.parse_args()
    if args.micro_child:
        return args
    h.resolve(
        args,
        quick={"noisy_factor": 2.0, "queue_timeout": 3.0, "solo": 2.0, "warmup": 2.0, "window": 4.0, "open_window": 3.0,
               "fair_window": 3.0,
               "micro_iterations": 1500},
        full={"noisy_factor": 10.0, "queue_timeout": 5.0, "solo": 8.0, "warmup": 3.0, "window": 20.0, "open_window": 10.0,
              "fair_window": 10.0,
              "micro_iterations": 20000},
    )
    if args.quiet_wait == 60.0 and not args.quick:
        args.quiet_wait = 20.0
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    args.slots = args.endpoints * args.capacity
    args.share = args.slots / (args.equal_keys + 2)
    if args.noisy_concurrency is None:
        args.noisy_concurrency = max(1, round(args.share))
    if args.batch_concurrency is None:
        args.batch_concurrency = max(1, round(args.share))
    args.noisy_clients = max(1, round(args.noisy_factor * args.slots))
    # An equal request's time in a slot when nothing queues: its prefill, its tokens, ~30 ms of
    # gateway and first-token overhead.
    args.service_s = args.equal_prompt / args.prefill_rate + args.output_tokens / args.decode_rate + 0.03
    args.equal_rate = args.equal_share * args.share / args.service_s
    args.fair_clients = max(1, math.ceil(args.fair_outstanding * args.slots / args.equal_keys))
    return args


# --- request bodies --------------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(n))


def equal_body(name: str, args: argparse.Namespace, *, stream: bool) -> bytes:
    text = f"{MARKER}:{name}: " + words(random.Random(name), args.equal_prompt) + f" [sim tokens={args.output_tokens}]"
    return json.dumps({"model": h.MODEL, "max_tokens": args.output_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": text}]}, separators=(",", ":")).encode()


def noisy_body(args: argparse.Namespace) -> bytes:
    body = json.loads(FIXTURE.read_text())["body"]
    body = {**body, "model": h.MODEL, "stream": False}
    user = [m for m in body["messages"] if m["role"] == "user"][-1]
    if isinstance(user["content"], str):
        user["content"] = [{"type": "text", "text": user["content"]}]
    user["content"].append({"type": "text", "text": f"{MARKER}:noisy: [sim tokens={args.output_tokens}]"})
    return json.dumps(body, separators=(",", ":")).encode()


# --- the stack -------------------------------------------------------------------------------------


def start_sims(stack: h.Stack, n: int, options: dict[str, Any]) -> list[h.SimProc]:
    """n generation sims started at once (Django's import is most of a start)."""
    sims = []
    for i in range(n):
        log_path = stack.tmp / f"sim-generation-{i}.log"
        command = [h.PYTHON, "manage.py", "simworker", "--role", "generation", "--host", "127.0.0.1", "--port", "0"]
        for key, value in options.items():
            command += [f"--{key.replace('_', '-')}", str(value)]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, cwd=h.PROJECT_ROOT, env=stack.env, stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=child_setup)
        sim = h.SimProc(name=f"sim-generation-{i}", process=process, log_path=log_path, role="generation")
        stack.procs.append(sim)
        sims.append(sim)
    deadline = time.monotonic() + 60
    for sim in sims:
        while not sim.url:
            for line in sim.log_tail(100000).splitlines():
                if " listening on " in line:
                    sim.url = line.strip().rsplit(" ", 1)[1]
            if sim.url:
                break
            if sim.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simworker did not start:\n{sim.log_tail()}")
            time.sleep(0.05)
    return sims


@dataclass
class Proxy:
    proc: h.Proc
    urls: list[str]
    control_port: int

    def epoch(self, name: str, cap: int | None = None, tenant_caps: dict[str, int] | None = None) -> None:
        query = f"name={name}" + (f"&cap={cap}" if cap is not None else "")
        if tenant_caps:
            query += "&tenant_caps=" + ",".join(f"{k}:{v}" for k, v in tenant_caps.items())
        post(self.control_port, f"/epoch?{query}")

    def stats(self) -> dict[str, Any]:
        return h.http_get_json(self.control_port, "/stats")[1]


def post(port: int, path: str) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", path)
        conn.getresponse().read()
    finally:
        conn.close()


def start_proxy(stack: h.Stack, upstreams: list[str], slots: int) -> Proxy:
    log_path = stack.tmp / "counting-proxy.log"
    command = [h.PYTHON, str(PROXY), "--engine-slots", str(slots)]
    for url in upstreams:
        command += ["--upstream", url]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=h.PROJECT_ROOT, env=stack.env, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=child_setup)
    proc = h.Proc(name="counting-proxy", process=process, log_path=log_path)
    stack.procs.append(proc)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = proc.log_tail(100000).splitlines()
        urls = [line.rsplit(" ", 1)[1] for line in lines if " listening on " in line and " control " not in line]
        control = [line.rsplit(" ", 1)[1] for line in lines if " control listening on " in line]
        if control and len(urls) == len(upstreams):
            return Proxy(proc, urls, h.port_of(control[0]))
        if process.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"the counting proxy did not start:\n{proc.log_tail()}")


@dataclass
class Redis:
    proc: h.Proc
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def shutdown(self) -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "shutdown", "nosave"], capture_output=True, timeout=10)


def start_redis(stack: h.Stack) -> Redis:
    """A private redis-server on a free port (never the machine's shared one)."""
    port = unused_port()
    log_path = stack.tmp / "redis.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                   stdout=log, stderr=subprocess.STDOUT)
    proc = h.Proc(name="redis", process=process, log_path=log_path)
    stack.procs.append(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        if ping.stdout.strip() == "PONG":
            return Redis(proc, port)
        time.sleep(0.1)
    raise RuntimeError(f"redis-server did not start:\n{proc.log_tail()}")


SETUP = """
import json
from messages_api.auth import create_api_key
from workers.models import WorkerEndpoint, WorkerPool
pool = WorkerPool.objects.create(name={pool!r}, model={model!r}, schedule_style="aggregated", routing="least_loaded",
                                 max_local_prefill_tokens=0)
for url in {urls!r}:
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=url)
keys = {{}}
for name in {names!r}:
    row, secret = create_api_key(name)
    if name == "batch":
        row.priority = "batch"
        row.save(update_fields=["priority"])
    keys[name] = secret
print(json.dumps(keys))
"""

# The phases where the noisy key has a per-minute limit (`configure(..., rpm=...)`) besides its
# concurrency: there its every 429 must carry anthropic-ratelimit-* headers.
PHASES_WITH_NOISY_RATE_LIMIT = frozenset({"redis"})


def configure(stack: h.Stack, capacity: int | None, concurrency: int | None = None, rpm: int | None = None) -> None:
    """The pool's capacity and the noisy key's limits, written to the database directly (a
    `manage.py` call costs seconds; every gateway is started after this, so none caches the old
    values)."""
    conn = sqlite3.connect(stack.tmp / "gateway.sqlite3", timeout=30)
    try:
        with conn:
            conn.execute("UPDATE workers_workerendpoint SET capacity = ? WHERE pool_id = (SELECT id FROM workers_workerpool WHERE name = ?)",
                         (capacity, POOL))
            conn.execute("UPDATE messages_api_apikey SET max_concurrency = ?, requests_per_minute = ? WHERE name = 'noisy'",
                         (concurrency, rpm))
    finally:
        conn.close()


def gateway_settings(args: argparse.Namespace, redis: Redis | None = None, prefix: str = "") -> dict[str, Any]:
    settings: dict[str, Any] = {"ADMISSION_QUEUE_TIMEOUT_S": args.queue_timeout, "REDIS_URL": ""}
    if args.headroom is not None:
        settings["ADMISSION_HEADROOM"] = args.headroom
    settings |= dict(item.split("=", 1) for item in args.gateway_setting)
    if redis is not None:
        settings |= {"REDIS_URL": redis.url, "REDIS_KEY_PREFIX": prefix, "REDIS_RETRY_S": 2}
    return settings


def start_gateways(stack: h.Stack, n: int, settings: dict[str, Any]) -> list[h.GatewayProc]:
    return [stack.start_gateway(settings) for _ in range(n)]


def stop_gateways(stack: h.Stack, gateways: list[h.GatewayProc]) -> None:
    for gateway in gateways:
        gateway.stop()
        if gateway in stack.procs:
            stack.procs.remove(gateway)


# --- the load ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Rec:
    """One request as the benchmark saw it (perf_counter times)."""

    key: str
    sent_at: float
    in_window: bool
    status: int = 0
    done_at: float | None = None
    ttft: float | None = None
    error: str = ""  # client-side failure, or the error type in the body
    message: str = ""  # the error's message
    in_stream_error: bool = False
    retry_after: float | None = None
    ratelimit_headers: bool = False
    output_tokens: int = 0
    request_id: str = ""
    gateway: int = 0


def record(rec: Rec, resp: h.Response, stream: bool) -> None:
    rec.status = resp.status
    rec.done_at = resp.done_at or time.perf_counter()
    head = resp.headers
    if resp.error:
        rec.error = resp.error
        return
    m = _REQUEST_ID.search(head)
    rec.request_id = m.group(1).decode().strip() if m else ""
    m = _RETRY_AFTER.search(head)
    rec.retry_after = float(m.group(1)) if m else None
    rec.ratelimit_headers = b"\r\nanthropic-ratelimit-" in head.lower()
    body = bytes(resp.body or b"")
    if resp.status == 200:
        if stream:
            if resp.first_count_at is not None:
                rec.ttft = resp.first_count_at - resp.sent_at
            if b"event: error" in body:
                m = _ERROR_TYPE.search(body)
                rec.error = m.group(1).decode() if m else "error event"
                rec.in_stream_error = True
            elif b"event: message_stop" not in body:
                rec.error = "stream ended without message_stop"
            found = _OUTPUT_TOKENS.findall(body)
            rec.output_tokens = int(found[-1]) if found and not rec.error else 0
        else:
            try:
                rec.output_tokens = int(json.loads(body)["usage"]["output_tokens"])
            except (ValueError, KeyError, TypeError):
                rec.error = "not a message"
    else:
        m = _ERROR_TYPE.search(body)
        rec.error = m.group(1).decode() if m else f"HTTP {resp.status}"
        m = _ERROR_MESSAGE.search(body)
        rec.message = m.group(1).decode(errors="replace") if m else ""


class Pools:
    """Idle keep-alive connections per gateway, for open-loop arrivals."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.idle: dict[int, list[h.HttpConnection]] = {p: [] for p in ports}
        self.all: list[h.HttpConnection] = []

    async def get(self, port: int) -> h.HttpConnection:
        idle = self.idle[port]
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
        conn = await h.connect(port)
        self.all.append(conn)
        return conn

    def put(self, port: int, conn: h.HttpConnection) -> None:
        if conn.usable:
            self.idle[port].append(conn)

    def close(self) -> None:
        for conn in self.all:
            conn.close()


@dataclass
class Load:
    """The traffic of one phase."""

    args: argparse.Namespace
    ports: list[int]
    keys: dict[str, str]
    equal: list[str]
    noisy: bool
    batch: bool
    window: float
    warmup: float
    equal_closed: bool = False  # the `fair` phase: each equal key backlogged (closed loop)
    recs: list[Rec] = field(default_factory=list)
    window_start: float = 0.0
    window_end: float = 0.0
    stop_flood: bool = False
    on_window_half: Any = None
    on_mark: Any = None  # called (in a thread) with "window" when the window opens, "drain" when it closes

    def wire(self, key: str, port: int, body: bytes) -> bytes:
        return h.gateway_request(port, self.keys[key], body)

    async def run(self) -> None:
        args = self.args
        loop = asyncio.get_running_loop()
        flood: list[asyncio.Task[None]] = []
        if self.noisy:
            wires_noisy = {p: self.wire("noisy", p, noisy_body(args)) for p in self.ports}
            flood += [loop.create_task(self.closed_loop("noisy", i, wires_noisy, False)) for i in range(args.noisy_clients)]
        if self.batch:
            batch_body = equal_body("batch", args, stream=False)
            wires_batch = {p: self.wire("batch", p, batch_body) for p in self.ports}
            flood += [loop.create_task(self.closed_loop("batch", i, wires_batch, False)) for i in range(args.batch_concurrency)]
        if self.equal_closed:
            for name in self.equal:
                body = equal_body(name, args, stream=True)
                wires = {p: self.wire(name, p, body) for p in self.ports}
                flood += [loop.create_task(self.closed_loop(name, i, wires, True)) for i in range(args.fair_clients)]
        pools = Pools(self.ports)
        arrivals: list[asyncio.Task[None]] = []
        started = time.perf_counter()
        self.window_start = started + (self.warmup if flood else 0.0)
        self.window_end = self.window_start + self.window
        # With --equal-warm the equal keys arrive from the start, so they are working (active)
        # when the window opens: a flood joining a team at work. Without, the flood has the pool
        # to itself during the warm-up, and each equal key's first request waits for a release.
        opening = started if (flood and args.equal_warm and not self.equal_closed) else self.window_start
        arriving = None if self.equal_closed else loop.create_task(self.open_loop(pools, arrivals, opening))
        if flood:
            await asyncio.sleep(max(0.0, self.window_start - time.perf_counter()))
        await self._mark("window")
        half = loop.create_task(self._half()) if self.on_window_half else None
        if arriving is None:
            await asyncio.sleep(self.window)
        else:
            await arriving
        await self._mark("drain")
        # Every answer to a request of the window, the flood going on meanwhile.
        if arrivals:
            _, pending = await asyncio.wait(arrivals, timeout=args.drain_limit)
            for task in pending:
                task.cancel()
        if half is not None:
            await half
        self.stop_flood = True
        if flood:
            # The noisy key's requests still in flight are cut (they are no one's figures); the
            # others' are answered (at most the queue timeout away, but in the `open` phase).
            if self.noisy:
                await self._mark("cut")
            for task in flood[: args.noisy_clients if self.noisy else 0]:
                task.cancel()
            _, pending = await asyncio.wait(flood, timeout=args.queue_timeout + 5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        pools.close()

    async def _mark(self, what: str) -> None:
        if self.on_mark is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.on_mark, what)

    async def _half(self) -> None:
        await asyncio.sleep(max(0.0, self.window_start + self.window / 2 - time.perf_counter()))
        await asyncio.get_running_loop().run_in_executor(None, self.on_window_half)

    async def open_loop(self, pools: Pools, tasks: list[asyncio.Task[None]], opening: float) -> None:
        """Poisson arrivals at the equal keys' total rate, dealt to the keys in turn: in aggregate
        the arrivals of independent keys, and each key offers the same load (Jain's index then
        measures what they got, not the luck of their draws)."""
        n = len(self.equal)
        rate = self.args.equal_rate * n
        rng = random.Random(self.args.seed)
        wires = {(name, p): self.wire(name, p, equal_body(name, self.args, stream=True)) for name in self.equal for p in self.ports}
        at = opening + rng.expovariate(rate)
        i = 0
        loop = asyncio.get_running_loop()
        while at < self.window_end:
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            name = self.equal[i % n]
            port = self.ports[(i // n) % len(self.ports)]
            tasks.append(loop.create_task(self.one(name, port, wires[name, port], pools)))
            i += 1
            at += rng.expovariate(rate)

    async def one(self, name: str, port: int, wire: bytes, pools: Pools) -> None:
        now = time.perf_counter()
        rec = Rec(name, now, now >= self.window_start, gateway=self.ports.index(port))
        self.recs.append(rec)
        try:
            conn = await pools.get(port)
            resp = await conn.request(wire, keep_body=True, count=DELTA)
        except OSError as exc:
            rec.error = f"connect: {exc}"
            rec.done_at = time.perf_counter()
            return
        except asyncio.CancelledError:
            rec.error = "cut at the drain limit"
            raise
        rec.sent_at = resp.sent_at
        record(rec, resp, stream=True)
        pools.put(port, conn)

    async def closed_loop(self, name: str, i: int, wires: dict[int, bytes], stream: bool) -> None:
        port = self.ports[i % len(self.ports)]
        conn = h.KeepAlive(port)
        # Spread the clients' first requests over a second (a real flood ramps too).
        await asyncio.sleep(random.Random(f"{name}{i}").random())
        try:
            while not self.stop_flood:
                now = time.perf_counter()
                rec = Rec(name, now, self.window_start <= now < self.window_end if self.window_start else False,
                          gateway=i % len(self.ports))
                self.recs.append(rec)
                try:
                    resp = await conn.request(wires[port], keep_body=True, count=DELTA if stream else b"")
                except OSError as exc:
                    rec.error = f"connect: {exc}"
                    rec.done_at = time.perf_counter()
                    await asyncio.sleep(0.1)
                    continue
                record(rec, resp, stream)
                if resp.status in (429, 529):
                    await asyncio.sleep(rec.retry_after if rec.retry_after is not None else 1.0)
                elif rec.error:
                    await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            if rec.done_at is None:
                rec.error = "cut at the end of the phase"
            raise
        finally:
            conn.close()


# --- what the gateways and the proxy said ------------------------------------------------------------


def audit_rows(db_path: Path, ids: list[str]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    if not ids:
        return rows
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            cursor = conn.execute(
                "SELECT request_id, api_key_name, status, http_status, queued_ms, first_token_ms, error_type "
                f"FROM messages_api_messagerequest WHERE request_id IN ({','.join('?' * len(chunk))})",
                chunk,
            )
            for rid, key, status, http_status, queued, first, error in cursor:
                rows[rid] = {"key": key, "status": status, "http_status": http_status, "queued_ms": queued,
                             "first_token_ms": first, "error_type": error}
    finally:
        conn.close()
    return rows


def metrics_text(gateway: h.GatewayProc) -> str:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def gateway_metrics(gateways: list[h.GatewayProc]) -> dict[str, float]:
    """Counters summed over the gateways (and each gateway's event-loop lag gauge)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for i, gateway in enumerate(gateways):
        for family in text_string_to_metric_families(metrics_text(gateway)):
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                if name == "gateway_shared_state_fallbacks_total":
                    keys = [name, f"{name}{{reason={labels.get('reason', '')}}}"]
                elif name == "gateway_admission_refusals_total":
                    keys = [f"{name}{{reason={labels.get('reason', '')}}}"]
                elif name in ("gateway_shed_requests_total", "gateway_admission_wait_seconds_count"):
                    keys = [name]
                elif name == "gateway_event_loop_lag_seconds":
                    keys = [f"{name} (gateway {i}, last probe)"]
                elif name in ("gateway_gc_pause_seconds_count", "gateway_gc_pause_seconds_sum") and labels.get("generation") == "2":
                    keys = [f"{name}{{generation=2}}"]  # full passes: each stops the loop while it walks the heap
                elif name == "gateway_gc_pause_seconds_bucket" and labels.get("generation") == "2" and labels.get("le") == "0.025":
                    keys = ["gateway_gc_pause_seconds{generation=2} <= 25 ms"]
                else:
                    continue
                for key in keys:
                    out[key] = out.get(key, 0.0) + float(sample.value)
    return out


# --- per key -----------------------------------------------------------------------------------------


def jain(values: list[float]) -> float:
    if not values or not any(values):
        return math.nan
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def ttft_by_half(recs: list[Rec], equal: list[str], at: float) -> dict[str, dict[str, dict[str, float]]]:
    """The equal keys' time to first token for the requests sent before `at` (Redis up) and after
    (Redis down: each process on its own state), so that the fallback's effect is seen apart."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key in equal:
        ok = [(r.sent_at, r.ttft) for r in recs if r.key == key and r.in_window and r.status == 200 and not r.error
              and r.ttft is not None]
        out[key] = {"up": h.distribution([ttft for sent, ttft in ok if sent < at]),
                    "down": h.distribution([ttft for sent, ttft in ok if sent >= at])}
    return out


def summarize(recs: list[Rec], audit: dict[str, dict[str, Any]], key: str, stream: bool, timeout: float) -> dict[str, Any]:
    mine = [r for r in recs if r.key == key and r.in_window and r.error not in ("cut at the end of the phase",)]
    ok = [r for r in mine if r.status == 200 and not r.error]
    s429 = [r for r in mine if r.status == 429]
    s529 = [r for r in mine if r.status == 529]
    shed = [r for r in s529 if r.message == "Overloaded"]
    in_stream_529 = [r for r in mine if r.in_stream_error and r.error == "overloaded_error"]
    fivexx = [r for r in mine if (500 <= r.status < 600 and r.status != 529) or (r.in_stream_error and r.error != "overloaded_error")]
    other = [r for r in mine if r not in ok and r not in s429 and r not in s529 and r not in in_stream_529 and r not in fivexx]
    queued = [(audit.get(r.request_id, {}).get("queued_ms") or 0.0) / 1000 for r in ok]
    slowest: list[dict[str, Any]] = []
    if stream:
        ttft = [r.ttft for r in ok if r.ttft is not None]
        # The worst few, with what the gateway's row says of them: a first token late at the
        # gateway too (first_token_ms, counted from the request's arrival) or only at the client.
        for r in sorted((r for r in ok if r.ttft is not None), key=lambda r: r.ttft or 0.0, reverse=True)[:3]:
            row = audit.get(r.request_id, {})
            slowest.append({"ttft_ms": (r.ttft or 0.0) * 1000, "queued_ms": row.get("queued_ms"),
                            "gateway_first_token_ms": row.get("first_token_ms"), "gateway": r.gateway})
    else:
        ttft = [audit[r.request_id]["first_token_ms"] / 1000 for r in ok
                if r.request_id in audit and audit[r.request_id]["first_token_ms"] is not None]
    waits_529 = [(r.done_at or r.sent_at) - r.sent_at for r in s529]
    reply_429 = [(r.done_at or r.sent_at) - r.sent_at for r in s429]
    all_queued = [(audit.get(r.request_id, {}).get("queued_ms") or 0.0) / 1000 for r in mine if r.request_id in audit]
    longest = max(all_queued + waits_529, default=0.0)
    bad_429 = [r for r in s429 if r.retry_after is None or not r.ratelimit_headers]
    bad_429_headers = [r for r in s429 if not r.ratelimit_headers]
    bad_429_retry = [r for r in s429 if r.retry_after is None or not 1 <= r.retry_after <= 59]
    bad_529 = [r for r in s529 if r.retry_after is None or r.retry_after > 59]
    missing_audit = [r for r in mine if r.request_id and r.request_id not in audit]
    listed: dict[str, int] = {}
    for r in fivexx + other:
        label = f"{r.status or '-'} {r.error}".strip()
        listed[label] = listed.get(label, 0) + 1
    return {
        "sent": len(mine),
        "completed": len(ok),
        "completed_share": len(ok) / len(mine) if mine else math.nan,
        "429": len(s429),
        "529": len(s529),
        "529_in_stream": len(in_stream_529),
        "529_shed_loop_lag": len(shed),
        "529_messages": _messages(s529),
        "5xx": len(fivexx),
        "other_errors": len(other),
        "errors_listed": listed,
        "queued_s": h.distribution(queued),
        "ttft_s": h.distribution(ttft),
        "slowest": slowest,
        "ttft_source": "client: first content_block_delta" if stream else "audit first_token_ms",
        "output_tokens": sum(r.output_tokens for r in ok),
        "longest_wait_s": longest,
        "waits_over_limit": sum(1 for w in all_queued + waits_529 if w > timeout + 1.0),
        "429_without_headers_or_retry_after": len(bad_429),
        "429_without_ratelimit_headers": len(bad_429_headers),
        "429_without_ratelimit_headers_by_reason": _reasons(bad_429_headers),
        "429_retry_after_missing_or_over_59": len(bad_429_retry),
        "429_reasons": _reasons(s429),
        "429_reply_s": h.distribution(reply_429),
        "529_bad_retry_after": len(bad_529),
        "529_retry_after_max": max((r.retry_after or 0 for r in s529), default=None),
        "missing_audit_rows": len(missing_audit),
    }


def _reasons(recs: list[Rec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if "concurrent requests" in r.message:
            reason = "concurrency"
        elif "rate limit of" in r.message:
            reason = "per-minute " + r.message.split("rate limit of ", 1)[1].split(" ", 1)[1].replace(" per minute.", "")
        elif "budget" in r.message:
            reason = "budget"
        else:
            reason = r.error or "?"
        out[reason] = out.get(reason, 0) + 1
    return out


def _messages(recs: list[Rec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        out[r.message] = out.get(r.message, 0) + 1
    return out


def client_overlap_max(recs: list[Rec], key: str) -> int:
    """Most of a key's admitted (200) requests open at once as the client saw them (sent → done):
    an upper bound on what the gateway held, since each interval contains the request's lease."""
    events = []
    for r in recs:
        if r.key == key and r.status == 200 and r.done_at is not None:
            events += [(r.sent_at, 1), (r.done_at, -1)]
    events.sort(key=lambda e: (e[0], e[1]))
    top = live = 0
    for _, d in events:
        live += d
        top = max(top, live)
    return top


# --- one phase ---------------------------------------------------------------------------------------


def run_phase(stack: h.Stack, proxy: Proxy, args: argparse.Namespace, name: str, gateways: list[h.GatewayProc], keys: dict[str, str], *,
              equal: list[str], noisy: bool, batch: bool, window: float, cap: int | None, tenant_caps: dict[str, int] | None,
              on_half: Any = None, equal_closed: bool = False) -> dict[str, Any]:
    print(f"\n== {name}: {', '.join(equal + (['noisy'] if noisy else []) + (['batch'] if batch else []))} "
          f"on {len(gateways)} gateway(s), window {window:g} s", flush=True)
    label = name.split(":")[0].replace(" ", "-")
    first_epoch = len(proxy.stats()["epochs"])
    proxy.epoch(f"{label}-warmup", cap, tenant_caps)
    current = {"name": label}

    def mark(what: str) -> None:
        # The window's own epoch (its means are the window's); the caps are watched in every one
        # but the last: when the bench cuts the noisy key's requests, the gateway frees their slots
        # at once and may send the next request before the proxy has read the cut connection's
        # close (a count the proxy cannot know sooner), so that epoch is not checked.
        if what == "cut":
            proxy.epoch(f"{current['name']}-cut")
        else:
            proxy.epoch(label if what == "window" else f"{current['name']}-drain", cap, tenant_caps)

    at_half: dict[str, Any] = {}

    def half() -> None:
        at_half["at"] = time.perf_counter()  # the clock of the requests' sent_at
        at_half["gateway_metrics"] = gateway_metrics(gateways)
        current["name"] = "redis-down"
        on_half()

    warmup = args.warmup if (noisy or batch) else 2.0 if equal_closed else 0.5
    load = Load(args, [g.port for g in gateways], keys, equal, noisy, batch, window, warmup, equal_closed=equal_closed,
                on_window_half=half if on_half else None, on_mark=mark)
    pids = {f"gateway {i}": g.pid for i, g in enumerate(gateways)} | {"proxy": proxy.proc.pid}
    meter = h.CpuMeter(pids).start()
    started = time.perf_counter()
    asyncio.run(load.run())
    meter.stop()
    elapsed = time.perf_counter() - started
    time.sleep(max(0.5, 4 * 0.25))  # the audit writers' flush
    ids = [r.request_id for r in load.recs if r.request_id and r.in_window]
    audit = audit_rows(stack.tmp / "gateway.sqlite3", ids)
    stats = proxy.stats()
    metrics = gateway_metrics(gateways)
    per_key = {k: summarize(load.recs, audit, k, stream=k.startswith("eq"), timeout=args.queue_timeout)
               for k in equal + (["noisy"] if noisy else []) + (["batch"] if batch else [])}
    tokens = [per_key[k]["output_tokens"] for k in equal]
    noisy_rates = {}
    if noisy:
        sent = [r for r in load.recs if r.key == "noisy" and r.in_window]
        noisy_rates = {"requests_per_s": len(sent) / window, "admitted_per_s": sum(1 for r in sent if r.status == 200) / window}
    result = {
        "elapsed_s": elapsed,
        "window_s": window,
        "keys": per_key,
        "jain_equal_tokens": jain(tokens) if len(tokens) > 1 else None,
        "noisy": noisy_rates,
        "noisy_client_overlap_max": client_overlap_max([r for r in load.recs if r.in_window], "noisy") if noisy else None,
        "proxy": stats["epochs"][first_epoch:],
        "gateway_metrics": metrics,
        "gateway_metrics_before_redis_stop": at_half.get("gateway_metrics"),
        "equal_ttft_by_half": ttft_by_half(load.recs, equal, at_half["at"]) if "at" in at_half else None,
        "cpu_seconds": meter.used,
        "cpu_cores": {k: v / meter.wall for k, v in meter.used.items()} if meter.wall else {},
        "machine_note": meter.machine_note(),
    }
    return result


# --- the admission path's CPU, in a child process ---------------------------------------------------


def micro_child(args: argparse.Namespace) -> None:
    """Runs in a child with the gateway's settings (REDIS_URL: the bench's private Redis): CPU per
    request (time.process_time: every thread of this process, the Redis client's work included,
    the Redis server's not) of the admission path as the gateway runs it for one request:
    `check_limits`, `admit` and, when the request ends, the slot's `capacity.release`,
    `notify_freed` and the key's `settle`. With Redis and limits that is four scripts: the check
    and the slot's acquire awaited, the release and the settle in the background, as in the
    gateway; requests follow one another without waiting for the background ones, which run
    while the next awaits its round trips, and the last are awaited inside the measure. The
    capped endpoints' capacity is large (the slot is taken and released all the same; no request
    waits in the queue: the CPU of a free pass through it)."""
    import django

    django.setup()
    from django.conf import settings

    from messages_api.limits import NO_LIMITS, KeyLimits, Usage, check_limits
    from workers.admission import Priority, Ticket, admit, capacity
    from workers.admission.queue import notify_freed
    from workers.cluster.registry import EndpointInfo

    n = args.micro_iterations

    def endpoints(capped: bool) -> list[EndpointInfo]:
        return [EndpointInfo(id=900 + i, pool_name="micro", role="generation", url=f"http://127.0.0.1:{20000 + i}", enabled=True,
                             draining=False, healthy=True, capacity=10**6 if capped else None) for i in range(4)]

    limits = KeyLimits(concurrency=10**6, requests_per_minute=10**9, input_tokens_per_minute=10**12,
                       output_tokens_per_minute=10**12, tokens_per_day=10**15, tokens_per_month=10**15)
    resource = ("micro", "generation")
    ticket = Ticket(flow="micro-key", session="s", priority=Priority.STANDARD, tokens=500, size=4000)
    usage = Usage(500, 64)
    turn = [0]

    def pick(roomy: list[EndpointInfo]) -> EndpointInfo:
        turn[0] += 1
        return roomy[turn[0] % len(roomy)]

    def held(endpoint_id: int) -> tuple[int, int]:
        return 0, 0

    async def drain() -> None:
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def case(key_limits: KeyLimits, capped: bool, n: int, redis: bool, part: str = "both") -> dict[str, float]:
        settings.REDIS_URL = redis_url if redis else ""
        eps = endpoints(capped)

        def usable(fresh: bool) -> list[EndpointInfo]:
            return eps

        async def once() -> None:
            if part != "admit":
                lease = await check_limits("micro-key-hash", key_limits, usage)
            if part != "limits":
                endpoint, slot = await admit(resource, ticket, usable, pick, tokens=564, held_here=held)
                if slot is not None:
                    capacity.release(endpoint, slot)
                    notify_freed(resource)
            if part != "admit":
                lease.settle(usage)

        for _ in range(min(500, n)):  # warm-up: scripts loaded, connections open
            await once()
        await drain()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            await once()
        await drain()
        cpu1, wall1 = time.process_time(), time.perf_counter()
        return {"cpu_us": (cpu1 - cpu0) / n * 1e6, "wall_us": (wall1 - wall0) / n * 1e6}

    async def empty(n: int) -> dict[str, float]:
        async def once() -> None:
            return None

        cpu0 = time.process_time()
        for _ in range(n):
            await once()
        return {"cpu_us": (time.process_time() - cpu0) / n * 1e6}

    redis_url = settings.REDIS_URL

    async def main() -> dict[str, Any]:
        return {
            "loop_floor": await empty(n),
            "no limits, uncapped pool": await case(NO_LIMITS, False, n, redis=False),
            "no limits, uncapped pool, REDIS_URL set": await case(NO_LIMITS, False, n, redis=True),
            "limits, capped pool, Redis": await case(limits, True, n, redis=True),
            "  of which limits (check + settle), Redis": await case(limits, True, n, redis=True, part="limits"),
            "  of which capacity (admit + release), Redis": await case(limits, True, n, redis=True, part="admit"),
            "limits, capped pool, no Redis": await case(limits, True, n, redis=False),
            "no limits, capped pool, no Redis": await case(NO_LIMITS, True, n, redis=False),
        }

    print("MICRO " + json.dumps(asyncio.run(main())), flush=True)


def run_micro(stack: h.Stack, args: argparse.Namespace, redis: Redis) -> dict[str, Any]:
    env = dict(stack.env) | {"REDIS_URL": redis.url, "REDIS_KEY_PREFIX": f"bench-tenants-micro-{os.getpid()}:"}
    redis_cpu0 = h.proc_cpu_seconds(redis.proc.pid)
    result = subprocess.run([h.PYTHON, str(Path(__file__).resolve()), "--micro-child", "--micro-iterations", str(args.micro_iterations)],
                            cwd=h.PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    redis_cpu = h.proc_cpu_seconds(redis.proc.pid) - redis_cpu0
    line = [line for line in result.stdout.splitlines() if line.startswith("MICRO ")]
    if result.returncode != 0 or not line:
        raise RuntimeError(f"the cpu child failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    out = json.loads(line[0][6:])
    # Redis served 3 cases of 4, 2 and 2 scripts per request: its CPU per script, for reference.
    out["redis_server_cpu_us_per_script"] = redis_cpu / ((args.micro_iterations + min(500, args.micro_iterations)) * 8) * 1e6
    return out


# --- printing -----------------------------------------------------------------------------------------


def ms(d: dict[str, float], q: str) -> float:
    return d.get(q, math.nan) * 1000 if d.get("n") else math.nan


def print_phase(name: str, result: dict[str, Any], solo: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    rows = []
    for key, k in result["keys"].items():
        base = solo.get(key, {}).get("ttft_s", {})
        ratio = ms(k["ttft_s"], "p99") / ms(base, "p99") if base.get("n") and k["ttft_s"].get("n") else math.nan
        rows.append([key, k["sent"], k["completed"], f"{100 * k['completed_share']:.2f}" if k["sent"] else "-",
                     k["429"], k["529"], k["529_in_stream"], k["5xx"], k["other_errors"],
                     ms(k["queued_s"], "p50"), ms(k["queued_s"], "p99"), ms(k["ttft_s"], "p50"), ms(k["ttft_s"], "p99"),
                     ms(base, "p99") if base.get("n") else math.nan, ratio, k["output_tokens"], k["longest_wait_s"]])
    h.print_table(f"{name} (window {result['window_s']:g} s; the phase took {result['elapsed_s']:.0f} s)",
                  ("key", "sent", "ok", "ok %", "429", "529", "529 strm", "5xx", "other", "queued p50 ms", "queued p99 ms",
                   "TTFT p50 ms", "TTFT p99 ms", "solo p99 ms", "p99/solo", "tokens", "longest wait s"), rows, digits=2)
    notes = []
    if result.get("jain_equal_tokens") is not None:
        notes.append(f"Jain's index over the equal keys' delivered tokens: {result['jain_equal_tokens']:.4f}")
    if result.get("noisy"):
        notes.append(f"noisy: {result['noisy']['requests_per_s']:.1f} requests/s offered in the window, "
                     f"{result['noisy']['admitted_per_s']:.2f}/s answered 200; most at once as the client saw them "
                     f"(an upper bound): {result['noisy_client_overlap_max']}")
    for epoch in result["proxy"]:
        ep_max = max(epoch["endpoint_max"].values(), default=0)
        queued = max(epoch["endpoint_max_queued"].values(), default=0)
        tenants = ", ".join(f"{t} {m}" for t, m in sorted(epoch["tenant_max"].items()))
        note = f"proxy epoch {epoch['name']}: most requests at one endpoint {ep_max}"
        if epoch["cap"]:
            note += f" (cap {epoch['cap']}; arrivals over it: {sum(epoch['endpoint_violations'].values())})"
        note += f"; most queued in an engine {queued}; most in flight per tenant: {tenants}"
        if epoch["tenant_caps"]:
            note += f"; arrivals over the tenant caps {epoch['tenant_caps']}: {sum(epoch['tenant_violations'].values())}"
        notes.append(note)
        if not epoch["name"].endswith(("-warmup", "-drain")):
            means = ", ".join(f"{t} {m:.1f}" for t, m in sorted(epoch["tenant_mean_in_flight"].items()) if m >= 0.05)
            running = sum(epoch["endpoint_mean_running"].values())
            notes.append(f"  in this window, mean requests at the engines per tenant: {means}; mean running over the pool: "
                         f"{running:.1f} of {args.slots}")
    for key, k in result["keys"].items():
        if k["errors_listed"]:
            notes.append(f"{key} errors: {k['errors_listed']}")
        if k["429"]:
            notes.append(f"{key} 429s by reason: {k['429_reasons']}; without anthropic-ratelimit-* headers: "
                         f"{k['429_without_ratelimit_headers']} {k['429_without_ratelimit_headers_by_reason'] or ''}; "
                         f"retry-after missing or not 1-59: {k['429_retry_after_missing_or_over_59']}; answered in "
                         f"p50 {ms(k['429_reply_s'], 'p50'):.1f} ms, p99 {ms(k['429_reply_s'], 'p99'):.1f} ms")
        if k["529"]:
            notes.append(f"{key} 529s: {k['529_messages']}; retry-after max {k['529_retry_after_max']:g}, bad {k['529_bad_retry_after']}")
        if k["missing_audit_rows"]:
            notes.append(f"{key}: {k['missing_audit_rows']} requests without an audit row")
    worst = {key: k["slowest"] for key, k in result["keys"].items() if k.get("slowest")}
    if worst:
        notes.append("the equal keys' slowest first tokens, ms (client TTFT / queued / the gateway's first_token_ms, gateway #): " + "; ".join(
            f"{key} " + ", ".join(f"{w['ttft_ms']:.0f}/{w['queued_ms'] or 0:.0f}/{w['gateway_first_token_ms'] or 0:.0f} #{w['gateway']}" for w in ws)
            for key, ws in worst.items()))
    if result.get("equal_ttft_by_half"):
        notes.append("equal keys' TTFT p50 / p99 ms, sent while Redis was up | after it stopped: " + "; ".join(
            f"{key} {ms(half['up'], 'p50'):.0f} / {ms(half['up'], 'p99'):.0f} | {ms(half['down'], 'p50'):.0f} / {ms(half['down'], 'p99'):.0f}"
            for key, half in result["equal_ttft_by_half"].items()))
    m = result["gateway_metrics"]
    notes.append("gateways: " + ", ".join(f"{k} {v:g}" for k, v in m.items()))
    if result.get("gateway_metrics_before_redis_stop"):
        before = result["gateway_metrics_before_redis_stop"]
        notes.append("gateways before Redis was stopped: " + ", ".join(f"{k} {v:g}" for k, v in before.items()))
    cores = result["cpu_cores"]
    notes.append("CPU cores: " + ", ".join(f"{k} {v:.2f}" for k, v in cores.items() if ":" not in k))
    notes.append(result["machine_note"])
    for note in notes:
        print("  " + note)


# --- main ---------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.micro_child:
        micro_child(args)
        return
    print(f"pool: {args.endpoints} × capacity {args.capacity} = {args.slots} slots; a share = {args.share:.2f} slots; "
          f"equal keys: {args.equal_keys} × {args.equal_rate:.2f} requests/s open loop (~{args.service_s:.2f} s each); "
          f"noisy: {args.noisy_clients} outstanding (closed loop, retry-after honoured), limit {args.noisy_concurrency} "
          f"when limited; batch: {args.batch_concurrency} closed loop; ADMISSION_QUEUE_TIMEOUT_S {args.queue_timeout:g}", flush=True)
    equal = [f"eq{i + 1}" for i in range(args.equal_keys)]
    results: dict[str, Any] = {"phases": {}}
    solo: dict[str, dict[str, Any]] = {}
    t_start = time.monotonic()
    with h.Stack("tenants", keep=args.keep) as stack:
        for name in list(stack.env):
            if name.startswith(("REDIS_", "ADMISSION_", "CAPACITY_")):
                del stack.env[name]
        stack.migrate()
        sims = start_sims(stack, args.endpoints, {
            "tokens_per_second": args.decode_rate, "prefill_tokens_per_second": args.prefill_rate,
            "local_prefill_tokens_per_second": args.prefill_rate, "prefill_concurrency": args.prefill_concurrency,
            "max_context_tokens": 262144,
        })
        proxy = start_proxy(stack, [s.url for s in sims], args.capacity)
        redis = start_redis(stack) if {"cpu", "redis"} & set(args.phases) else None
        keys = json.loads(stack.manage("shell", "-c", SETUP.format(pool=POOL, model=h.MODEL, urls=proxy.urls,
                                                                   names=equal + ["noisy", "batch"])).strip().splitlines()[-1])
        quiet = h.wait_for_quiet(args.quiet_wait)
        print(f"stack up in {time.monotonic() - t_start:.0f} s; {quiet}", flush=True)
        results["quiet"] = quiet

        def flood(name: str, n_gateways: int, settings: dict[str, Any], cap: int | None, tenant_caps: dict[str, int] | None,
                  on_half: Any = None, window: float | None = None, noisy: bool = True, batch: bool = True,
                  equal_closed: bool = False) -> dict[str, Any]:
            gateways = start_gateways(stack, n_gateways, settings)
            try:
                with h.profiled([g.pid for g in gateways], h.result_name(args, "tenants") + "-" + name.split(":")[0] + "-gateway", args.profile):
                    result = run_phase(stack, proxy, args, name, gateways, keys, equal=equal, noisy=noisy, batch=batch,
                                       window=window or args.window, cap=cap, tenant_caps=tenant_caps, on_half=on_half,
                                       equal_closed=equal_closed)
            finally:
                stop_gateways(stack, gateways)
            print_phase(name, result, solo, args)
            return result

        if "solo" in args.phases:
            configure(stack, args.capacity)
            gateways = start_gateways(stack, 1, gateway_settings(args))
            try:
                for key in equal:
                    r = run_phase(stack, proxy, args, f"solo {key}", gateways, keys, equal=[key], noisy=False, batch=False,
                                  window=args.solo, cap=args.capacity, tenant_caps=None)
                    solo[key] = r["keys"][key]
                    results["phases"][f"solo {key}"] = r
            finally:
                stop_gateways(stack, gateways)
            rows = [[k, v["sent"], v["completed"], ms(v["queued_s"], "p99"), ms(v["ttft_s"], "p50"), ms(v["ttft_s"], "p99"),
                     v["output_tokens"]] for k, v in solo.items()]
            h.print_table("solo runs (each equal key alone, capacity set)",
                          ("key", "sent", "ok", "queued p99 ms", "TTFT p50 ms", "TTFT p99 ms", "tokens"), rows)
        if "quiet" in args.phases:
            configure(stack, args.capacity)
            results["phases"]["quiet"] = flood("quiet: capacity set, no noisy key (equal keys and batch)", 1, gateway_settings(args),
                                               args.capacity, None, noisy=False)
        if "admission" in args.phases:
            configure(stack, args.capacity)
            results["phases"]["admission"] = flood("admission: capacity set, noisy unlimited", 1, gateway_settings(args),
                                                   args.capacity, None)
        if "limited" in args.phases:
            configure(stack, args.capacity, concurrency=args.noisy_concurrency)
            results["phases"]["limited"] = flood(f"limited: capacity set, noisy concurrency {args.noisy_concurrency}", 1,
                                                 gateway_settings(args), args.capacity, {"noisy": args.noisy_concurrency})
        if "fair" in args.phases:
            configure(stack, args.capacity)
            results["phases"]["fair"] = flood(f"fair: capacity set, the equal keys alone, each keeping {args.fair_clients} streams "
                                              "outstanding (closed loop: the pool saturated)", 1, gateway_settings(args), args.capacity,
                                              None, window=args.fair_window, noisy=False, batch=False, equal_closed=True)
        if "open" in args.phases:
            configure(stack, None)
            results["phases"]["open"] = flood("open: no admission control (no capacity, no limits)", 1, gateway_settings(args),
                                              None, None, window=args.open_window)
        if "cpu" in args.phases:
            assert redis is not None
            print("\n== cpu: the admission path in-process", flush=True)
            micro = run_micro(stack, args, redis)
            results["phases"]["cpu"] = micro
            rows = [[name, v["cpu_us"], v.get("wall_us", math.nan)] for name, v in micro.items() if isinstance(v, dict)]
            h.print_table(f"admission path per request ({args.micro_iterations} requests per case; CPU of the gateway-side process)",
                          ("case", "CPU µs", "wall µs"), rows, digits=1)
            print(f"  the Redis server's own CPU per script (not the gateway's; for reference): "
                  f"{micro['redis_server_cpu_us_per_script']:.1f} µs")
        if "redis" in args.phases:
            assert redis is not None
            configure(stack, args.capacity, concurrency=args.noisy_concurrency, rpm=args.noisy_rpm)
            prefix = f"bench-tenants-{os.getpid()}-{int(time.time())}:"
            def stop_redis() -> None:
                proxy.epoch("redis-down", args.capacity, {"noisy": args.noisy_concurrency})
                redis.shutdown()
                print("  (redis-server shut down half-way through the window)", flush=True)

            stopped = " (stopped half-way)" if args.redis_stop else ""
            results["phases"]["redis"] = flood(f"redis: 2 gateways, shared Redis{stopped}, noisy concurrency "
                                               f"{args.noisy_concurrency} + {args.noisy_rpm} rpm", 2,
                                               gateway_settings(args, redis, prefix), args.capacity, {"noisy": args.noisy_concurrency},
                                               on_half=stop_redis if args.redis_stop else None)
    results["verdicts"] = verdicts(results, solo, args)
    print_verdicts(results["verdicts"])
    print(f"\ntotal {time.monotonic() - t_start:.0f} s")
    h.write_result(h.result_name(args, "tenants"), {"config": config(args), **results})


def config(args: argparse.Namespace) -> dict[str, Any]:
    keep = ("phases", "endpoints", "capacity", "decode_rate", "prefill_rate", "prefill_concurrency", "output_tokens", "equal_keys",
            "equal_prompt", "equal_share", "noisy_factor", "noisy_clients", "noisy_concurrency", "noisy_rpm", "batch_concurrency",
            "queue_timeout", "solo", "warmup", "window", "open_window", "micro_iterations", "slots", "share", "service_s",
            "equal_rate", "seed", "quick")
    return {k: getattr(args, k) for k in keep} | {"fixture": str(FIXTURE.relative_to(h.PROJECT_ROOT)),
                                                  "equal_arrivals": "open loop (Poisson)",
                                                  "noisy_and_batch": "closed loop, retry-after honoured",
                                                  "engine": "counting proxy: at most --capacity running per endpoint, FIFO beyond"}


# --- verdicts -----------------------------------------------------------------------------------------


def verdicts(results: dict[str, Any], solo: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each target per phase: met (True), missed (False), or None for a figure given for reading
    only (the open phase is the baseline without admission control; Redis down is the documented
    per-process fallback)."""
    out: list[dict[str, Any]] = []
    phases = results["phases"]
    timeout = args.queue_timeout
    quiet = phases.get("quiet", {}).get("keys", {})

    def add(phase: str, target: str, figure: str, met: bool | None) -> None:
        out.append({"phase": phase, "target": target, "figure": figure, "met": met})

    for phase in ("quiet", "admission", "limited", "redis", "open"):
        if phase not in phases:
            continue
        r = phases[phase]
        keys = r["keys"]
        flood = "noisy" in keys
        well = [k for k in keys if k != "noisy"]
        graded = flood and phase != "open"  # the targets are about admission control under a flood
        worst = min(well, key=lambda k: keys[k]["completed_share"])
        fivexx = sum(keys[k]["5xx"] for k in well)
        shed = sum(keys[k]["529_shed_loop_lag"] for k in well)
        add(phase, "well-behaved keys ≥ 99.9 % completed, no 5xx",
            f"worst {100 * keys[worst]['completed_share']:.2f} % ({worst}: {keys[worst]['529']} 529); 5xx {fivexx}; "
            f"well-behaved 529s shed for event-loop lag: {shed}",
            (keys[worst]["completed_share"] >= 0.999 and fivexx == 0) if graded else None)
        ratios = {k: keys[k]["ttft_s"]["p99"] / solo[k]["ttft_s"]["p99"] for k in well
                  if k in solo and solo[k]["ttft_s"].get("n") and keys[k]["ttft_s"].get("n")}
        if ratios:
            k = max(ratios, key=ratios.__getitem__)
            figure = f"worst {ratios[k]:.2f}× ({k}: {1000 * keys[k]['ttft_s']['p99']:.0f} vs {1000 * solo[k]['ttft_s']['p99']:.0f} ms)"
            if quiet and phase != "quiet":
                vs_quiet = {k: keys[k]["ttft_s"]["p99"] / quiet[k]["ttft_s"]["p99"] for k in ratios if quiet.get(k, {}).get("ttft_s", {}).get("n")}
                if vs_quiet:
                    figure += f"; vs the quiet phase worst {max(vs_quiet.values()):.2f}×"
            add(phase, "equal keys' TTFT p99 ≤ 1.25 × solo", figure, (ratios[k] <= 1.25) if graded else None)
        longest = max(k["longest_wait_s"] for k in keys.values())
        over = sum(k["waits_over_limit"] for k in keys.values())
        add(phase, f"no wait > queue timeout + 1 s ({timeout + 1:g} s)", f"longest {longest:.2f} s, {over} over", over == 0)
        n_529 = sum(k["529"] for k in keys.values())
        bad_529 = sum(k["529_bad_retry_after"] for k in keys.values())
        stream_529 = sum(k["529_in_stream"] for k in keys.values())
        add(phase, "every 529 has retry-after ≤ 59",
            f"{n_529} 529s, {bad_529} without" + (f"; {stream_529} overloaded_error events in streams (no header possible)" if stream_529 else ""),
            bad_529 == 0)
        n_429 = sum(k["429"] for k in keys.values())
        if n_429:
            no_headers = sum(k["429_without_ratelimit_headers"] for k in keys.values())
            no_retry = sum(k["429_retry_after_missing_or_over_59"] for k in keys.values())
            reasons: dict[str, int] = {}
            for k in keys.values():
                for reason, count in k["429_without_ratelimit_headers_by_reason"].items():
                    reasons[reason] = reasons.get(reason, 0) + count
            # Anthropic's headers describe rates and token budgets; a concurrency limit has none. A
            # key whose only limit is its concurrency (the noisy key outside `redis`) is therefore
            # answered without them, as the issue asks ("the headers for the limits that apply").
            exempt = reasons.get("concurrency", 0) if phase not in PHASES_WITH_NOISY_RATE_LIMIT else 0
            add(phase, "every 429 has retry-after and anthropic-ratelimit-* headers (for the limits that have them)",
                f"{n_429} 429s; {no_headers} without the headers {reasons or ''}"
                + (f" ({exempt} of them for a key whose only limit is its concurrency: no header applies)" if exempt else "")
                + f"; {no_retry} without a 1-59 s retry-after",
                no_headers - exempt == 0 and no_retry == 0)
        if phase in ("admission", "limited", "redis", "quiet"):
            checked = [e for e in r["proxy"] if not e["name"].endswith("-cut")]
            groups = {"up": [e for e in checked if not e["name"].startswith("redis-down")],
                      "down": [e for e in checked if e["name"].startswith("redis-down")]}
            for group, epochs in groups.items():
                if not epochs:
                    continue
                down = group == "down"
                label = " (Redis down: the per-process fallback)" if down else " (2 processes, Redis)" if phase == "redis" else ""
                ep_max = max((m for e in epochs for m in e["endpoint_max"].values()), default=0)
                ep_over = sum(sum(e["endpoint_violations"].values()) for e in epochs)
                add(phase, f"endpoint capacity {args.capacity} never exceeded{label}",
                    f"max {ep_max} at one endpoint, arrivals over {ep_over}", None if down else ep_over == 0)
                if any(e["tenant_caps"] for e in epochs):
                    t_max = max(e["tenant_max"].get("noisy", 0) for e in epochs)
                    t_over = sum(sum(e["tenant_violations"].values()) for e in epochs)
                    add(phase, f"noisy concurrency {args.noisy_concurrency} never exceeded{label}",
                        f"max {t_max} at the engines, arrivals over {t_over}", None if down else t_over == 0)
        if phase == "redis" and not args.redis_stop:
            fallbacks = r["gateway_metrics"].get("gateway_shared_state_fallbacks_total", 0)
            add(phase, "Redis up throughout: no fallback to per-process state", f"fallbacks {fallbacks:g}", fallbacks == 0)
        elif phase == "redis":
            all_5xx = sum(k["5xx"] for k in keys.values())
            fallbacks = r["gateway_metrics"].get("gateway_shared_state_fallbacks_total", 0)
            add(phase, "Redis stopped: 0 5xx (529s aside), the fallback counted",
                f"5xx {all_5xx}; gateway_shared_state_fallbacks_total {fallbacks:g}", all_5xx == 0 and fallbacks > 0)
            before = r.get("gateway_metrics_before_redis_stop") or {}
            up = {k: v for k, v in before.items() if k.startswith("gateway_shared_state_fallbacks_total{")}
            add(phase, "Redis up: no fallback to per-process state", f"fallbacks before the stop: {up or 0}",
                None if not before else not any(up.values()))
    if "fair" in phases:
        j = phases["fair"]["jain_equal_tokens"]
        tokens = {k: v["output_tokens"] for k, v in phases["fair"]["keys"].items()}
        add("fair", "saturated pool, four equal keys: Jain's index ≥ 0.95 over delivered tokens", f"{j:.4f} {tokens}", j >= 0.95)
    for phase in ("admission", "limited", "redis"):
        if phase in phases and phases[phase].get("jain_equal_tokens") is not None:
            j = phases[phase]["jain_equal_tokens"]
            add(phase, "Jain's index over the equal keys' tokens (same offered load) ≥ 0.95", f"{j:.4f}", j >= 0.95)
    if "cpu" in phases:
        m = phases["cpu"]
        a = m["no limits, uncapped pool"]["cpu_us"]
        b = m["limits, capped pool, Redis"]["cpu_us"]
        add("cpu", "≤ 10 µs: key without limits, uncapped pool", f"{a:.1f} µs", a <= 10)
        add("cpu", "≤ 100 µs: key with limits, capped pool, Redis", f"{b:.1f} µs", b <= 100)
    return out


def print_verdicts(items: list[dict[str, Any]]) -> None:
    print("\ntargets")
    for v in items:
        mark = "info" if v["met"] is None else h.verdict(v["met"])
        print(f"  {mark:4}  {v['phase']:9}  {v['target']}: {v['figure']}")


if __name__ == "__main__":
    main()
