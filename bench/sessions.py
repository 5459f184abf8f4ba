#!/usr/bin/env python
"""Claude Code-shaped sessions against a cached, disaggregated pool, per routing policy.

    .venv/bin/python bench/sessions.py                 # 8 sessions of 5-12 turns per policy
    .venv/bin/python bench/sessions.py --quick         # 4 sessions of 3-5 turns (a minute or two)
    .venv/bin/python bench/sessions.py --sessions 16 --turns-min 5 --turns-max 30 --policies cache_aware,oracle

The two regimes the README quotes (15-20 minutes together):

    # small: 16 sessions, 80k-token caches (every policy's caches hold most of the working set)
    .venv/bin/python bench/sessions.py --sessions 16 --turns-min 5 --turns-max 10 --kv-cache-tokens 80000
    # working set larger than one worker's cache, smaller than the pool's
    .venv/bin/python bench/sessions.py --sessions 48 --turns-min 5 --turns-max 20 --think-min 2 --think-max 8 \
        --ramp 30 --kv-cache-tokens 192000

N concurrent synthetic sessions: a shared system prompt and tool list (`--system-tokens`, ~20k
tokens, as Claude Code's), each turn appending a user message of `--append-min`..`--append-max`
tokens (plus the answer), `--turns-min`..`--turns-max` turns, `--think-min`..`--think-max`
seconds of think time between turns, sessions starting evenly over `--ramp` seconds (all at once
would make every first turn prefill the shared prompt at the same moment). Every policy sees the
same sessions (one seed).

The pool: 2 context and 4 generation sims, each with a prefix cache of `--kv-cache-tokens`
(LRU, 16-token blocks), prefill costed per *uncached* token at `--prefill-rate` tokens/s, one
prefill at a time per worker (queued prompts wait, as on one accelerator), streamed output at
`--decode-rate` tokens/s. The pool's `max_local_prefill_tokens` is `--max-local-prefill`: for
`cache_aware` the uncached-token threshold of conditional disaggregation (TensorRT-LLM's rule);
for the other policies it compares the whole prompt, as before, and never skips for these prompts.

Policies: `round_robin`, `least_loaded`, `session_affinity` with the `X-Claude-Code-Session-Id`
header and without it (it falls back to least loaded), `cache_aware` with and without the header,
and `oracle`: the benchmark asks every generation sim how much of the prompt it holds
(`POST /sim/prefix_cache/match`, the sims' real cache state) and sends the request to a pool of
that one generation endpoint (the same 2 context sims; SGLang's load guard applied to the
benchmark's own count of open requests; ties, and a conversation's first turn: the endpoint its
conversations' last turns went to least often, then the fewest open requests), so routing has full
knowledge of every worker's cache.
Whether a turn skips its context phase is still the gateway's call, on its approximate index;
`oracle+events` makes that call on what the chosen engine reports it holds (its KV-cache events).
`cache_aware+events`: the generation sims publish vLLM's KV-cache events and the gateway follows
them (workers/kv_events/): a conversation's later turns are scored by the blocks each engine
holds of its learned earlier prompt. The join learns token ids from vLLM's `return_token_ids`, so
compare it with `--protocol vllm` (every policy then runs on vLLM's dialect).

`--gateways 2`: two gateway processes on ports of their own, sharing Redis (learned prompts,
limits); a conversation's turns alternate between them, as behind a load balancer.
`--outside-clients N`: N clients send requests straight to the first generation sim for the whole
run (its queue grows long; no gateway sees them), the gateways poll the engines' metrics
(`ENGINE_LOAD_POLL_S`), and the report says how many new conversations went to that sim, and how
many of those while another generation sim had nothing open. Where each turn went comes from the
gateways' audit rows (`per_turn` in the JSON).

Reported per policy: prefill tokens computed (all 6 sims), cache hit rate (cached / (cached +
computed) over every prefill), context phases skipped, time to first token (first
`content_block_delta`, client side) p50/p99, and load imbalance (max / mean over the generation
sims of their time-averaged open requests, sampled every 50 ms). Then the prefix index's own cost,
in this process: CPU of one request's whole index work on the largest prompt of the run (see
`index_cost`), and memory at 10,000 sessions. The gateway's index is sized like the sims' caches
(`--index-marks`), as an operator sizes it like the workers' KV capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402
import httpx  # noqa: E402

from messages_api.convert import to_chat_request  # noqa: E402
from tests.support.ports import unused_port  # noqa: E402

BLOCK_TOKENS = 16
POLICIES = (
    "round_robin",
    "least_loaded",
    "session_affinity+header",
    "session_affinity",
    "cache_aware+header",
    "cache_aware",
    "cache_aware+events",
    "oracle",
    "oracle+events",
)
# SGLang's load guard, as the gateway applies it (PREFIX_BALANCE_* defaults), for the oracle.
BALANCE_ABS, BALANCE_REL = 4, 1.5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, help="concurrent sessions (default 8; --quick 4)")
    parser.add_argument("--turns-min", type=int, help="(default 5; --quick 3)")
    parser.add_argument("--turns-max", type=int, help="(default 12; --quick 5)")
    parser.add_argument("--think-min", type=float, help="seconds (default 0.5; --quick 0.2)")
    parser.add_argument("--think-max", type=float, help="seconds (default 2.0; --quick 0.6)")
    parser.add_argument("--ramp", type=float, help="seconds over which sessions start, evenly (default 8; --quick 2)")
    parser.add_argument("--append-min", type=int, default=200, help="tokens a turn appends, at least")
    parser.add_argument("--append-max", type=int, default=2000, help="tokens a turn appends, at most")
    parser.add_argument("--system-tokens", type=int, default=20000, help="shared system prompt + tools")
    parser.add_argument("--kv-cache-tokens", type=int, default=100000, help="prefix cache per sim, in tokens")
    parser.add_argument("--prefill-rate", type=float, default=40000.0, help="prefill tokens/s (context and local)")
    parser.add_argument("--decode-rate", type=float, default=200.0, help="streamed tokens/s")
    parser.add_argument("--output-tokens", type=int, default=16, help="max_tokens per turn")
    parser.add_argument("--max-local-prefill", type=int, default=2048, help="the pool's max_local_prefill_tokens")
    parser.add_argument("--index-chunk-bytes", type=int, default=16384, help="the gateway's PREFIX_INDEX_CHUNK_BYTES")
    parser.add_argument(
        "--index-marks", type=int,
        help="the gateway's PREFIX_INDEX_CHUNKS_PER_ENDPOINT (default: sized like the sims' caches, as an operator "
        "would: the cache's tokens in rendered bytes over the chunk size, plus one end mark per session)",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of: " + ", ".join(POLICIES))
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument(
        "--gateways", type=int, default=1,
        help="gateway processes, each on its own port, sharing Redis (REDIS_URL, default redis://127.0.0.1:6379/0) for the learned "
        "prompts and limits; a conversation's turns alternate between them, as behind a load balancer",
    )
    parser.add_argument(
        "--outside-clients", type=int, default=0,
        help="outside traffic: this many clients sending requests straight to the first generation sim the whole run (its queue "
        "grows long); the gateways then poll the engines' metrics (--engine-load-poll)",
    )
    parser.add_argument("--outside-prompt-tokens", type=int, default=4000, help="tokens of each outside request's (unique) prompt")
    parser.add_argument("--gateway-setting", action="append", default=[], metavar="NAME=VALUE", help="another setting of the gateways (repeatable)")
    parser.add_argument("--engine-load-poll", type=float, help="the gateways' ENGINE_LOAD_POLL_S (default: 0.5 with outside traffic, else off)")
    parser.add_argument(
        "--protocol", default="trtllm", choices=["trtllm", "vllm"],
        help="the sims' and pools' protocol; `cache_aware+events` needs vllm (the join learns token ids from vLLM's return_token_ids)",
    )
    args = h.parse_args(
        parser,
        quick={"sessions": 4, "turns_min": 3, "turns_max": 5, "think_min": 0.2, "think_max": 0.6, "ramp": 2.0},
        full={"sessions": 8, "turns_min": 5, "turns_max": 12, "think_min": 0.5, "think_max": 2.0, "ramp": 8.0},
    )
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.engine_load_poll is None:
        args.engine_load_poll = 0.5 if args.outside_clients else 0.0
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies: {', '.join(sorted(unknown))}")
    return args


# --- the workload ----------------------------------------------------------------------------------


def words(rng: random.Random, count: int) -> str:
    # One sim token per word (the sim's tokenizer splits on words and punctuation).
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(count))


@dataclass
class Workload:
    system: str
    tools: list[dict[str, Any]]
    # Per session: [(appended user text, seconds to wait before it)]; the first turn's wait is
    # the session's start within the ramp.
    sessions: list[list[tuple[str, float]]]


def build_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    tool_tokens = args.system_tokens * 2 // 5  # Claude Code: ~24 tool schemas, the rest prose
    tools = [
        {
            "name": f"Tool{i}",
            "description": words(rng, max(tool_tokens // 24 - 20, 1)),
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        }
        for i in range(24)
    ]
    system = words(rng, args.system_tokens - tool_tokens)
    sessions = []
    for n in range(args.sessions):
        turns = rng.randint(args.turns_min, args.turns_max)
        sessions.append(
            [
                (f"session {n} turn {t}: " + words(rng, rng.randint(args.append_min, args.append_max)),
                 n * args.ramp / args.sessions if t == 0 else rng.uniform(args.think_min, args.think_max))
                for t in range(turns)
            ]
        )
    return Workload(system, tools, sessions)


# --- one policy's run -------------------------------------------------------------------------------


@dataclass
class Sims:
    context: list[h.SimProc]
    generation: list[h.SimProc]

    @property
    def all(self) -> list[h.SimProc]:
        return self.context + self.generation


def start_sims(stack: h.Stack, args: argparse.Namespace, *, events: bool = False) -> Sims:
    """The pool's sims; with `events`, each generation sim publishes vLLM's KV-cache events on
    loopback ports of its own (`SimProc.kv_events`)."""
    options: dict[str, Any] = {
        "protocol": args.protocol,
        "tokens_per_second": args.decode_rate,
        "prefill_tokens_per_second": args.prefill_rate,
        "local_prefill_tokens_per_second": args.prefill_rate,
        "prefill_concurrency": 1,
        "kv_block_tokens": BLOCK_TOKENS,
        "kv_cache_blocks": args.kv_cache_tokens // BLOCK_TOKENS,
        "max_context_tokens": 262144,
        "kv_timeout": 60,
    }
    generation = []
    for _ in range(4):
        extra: dict[str, Any] = {}
        if events:
            extra = {"kv_events": f"tcp://127.0.0.1:{unused_port()}", "kv_events_replay": f"tcp://127.0.0.1:{unused_port()}"}
        sim = start_sim(stack, "generation", {**options, **extra})
        sim.kv_events = (extra.get("kv_events", ""), extra.get("kv_events_replay", ""))  # type: ignore[attr-defined]
        generation.append(sim)
    return Sims([start_sim(stack, "context", options) for _ in range(2)], generation)


def start_sim(stack: h.Stack, role: str, options: dict[str, Any], attempts: int = 3) -> h.SimProc:
    """A sim, started again if it was not up within the harness's 30 s (a loaded machine can take
    that long to import Django)."""
    for attempt in range(attempts):
        try:
            return stack.start_simworker(role, **options)
        except RuntimeError:
            stack.procs[-1].stop()
            if attempt == attempts - 1:
                raise
            print(f"  (a {role} sim was slow to start; starting another)", flush=True)
    raise AssertionError("unreachable")


def create_pools(stack: h.Stack, pools: list[dict[str, Any]]) -> None:
    """All the run's pools and endpoints in one `manage.py shell` (one Django start-up)."""
    code = (
        "import json\n"
        "from workers.models import WorkerPool, WorkerEndpoint\n"
        f"for spec in json.loads({json.dumps(json.dumps(pools))}):\n"
        # Shared caches: the oracle probes the sims' caches unsalted (`/sim/prefix_cache/match`),
        # and a per-key pool would salt every prompt of the run's key.
        "    pool = WorkerPool.objects.create(name=spec['name'], model=spec['name'], routing=spec['routing'],\n"
        "        schedule_style='context_first', max_local_prefill_tokens=spec['limit'], cache_scope='shared',\n"
        "        protocol=spec['protocol'])\n"
        "    for role, url, pub, replay in spec['endpoints']:\n"
        "        WorkerEndpoint.objects.create(pool=pool, role=role, url=url, kv_events_address=pub, kv_events_replay_address=replay,\n"
        f"            kv_block_size={BLOCK_TOKENS}, kv_hash_algorithm='sha256' if pub else '')\n"
    )
    stack.manage("shell", "-c", code)


@dataclass
class Turn:
    """One answered turn as the client saw it; `audit_turns` adds where the gateway sent it."""

    session: int
    turn: int
    gateway: int
    request_id: str
    ttft: float | None
    #: The generation sims with no open request when it was sent (the latest sample).
    idle_elsewhere: list[int]
    generation_endpoint: str = ""
    context_endpoint: str = ""
    input_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class RunResult:
    ttft: list[float] = field(default_factory=list)
    turns: int = 0
    errors: list[str] = field(default_factory=list)
    active_samples: list[list[int]] = field(default_factory=list)
    answered: list[Turn] = field(default_factory=list)
    outside_sent: int = 0


class Oracle:
    """Routes with the generation sims' real cache state."""

    def __init__(self, client: httpx.AsyncClient, generation: list[h.SimProc], models: list[str]) -> None:
        self.client = client
        self.generation = generation
        self.models = models
        self.open = [0] * len(generation)
        # Per session, the endpoint its last turn went to: ties go to the endpoint serving the
        # fewest conversations (as `cache_aware` places new ones), then the fewest open requests.
        self.placed: dict[int, int] = {}

    async def choose(self, body: dict[str, Any], session: int) -> int:
        chat = to_chat_request(body)
        probe = {"messages": chat["messages"], "tools": chat.get("tools")}
        answers = await asyncio.gather(
            *(self.client.post(g.url + "/sim/prefix_cache/match", json=probe) for g in self.generation),
            return_exceptions=True,
        )
        # A probe that failed counts as nothing cached there (the turn itself will say more).
        cached = [a.json()["cached_tokens"] if isinstance(a, httpx.Response) and a.status_code == 200 else 0 for a in answers]
        conversations = [0] * len(self.generation)
        for placed in self.placed.values():
            conversations[placed] += 1
        # A new conversation shares only the system prompt with the others: wherever it goes
        # (a cold engine prefills that once), it goes where the fewest conversations are, else
        # every one would follow the first engines to hold the system prompt.
        best = max(cached) if session in self.placed else min(cached)
        chosen = min((i for i, c in enumerate(cached) if c >= best), key=lambda i: (conversations[i], self.open[i]))
        lowest = min(self.open)
        if self.open[chosen] - lowest > BALANCE_ABS and self.open[chosen] > BALANCE_REL * lowest:
            chosen = self.open.index(lowest)
        self.placed[session] = chosen
        return chosen


async def run_session(
    client: httpx.AsyncClient,
    gateways: list[str],
    key: str,
    model: str,
    workload: Workload,
    index: int,
    *,
    header: bool,
    oracle: Oracle | None,
    result: RunResult,
    output_tokens: int,
) -> None:
    messages: list[dict[str, Any]] = []
    session_id = f"bench-session-{index}-{time.monotonic_ns()}"
    for turn, (text, think) in enumerate(workload.sessions[index]):
        if think:
            await asyncio.sleep(think)
        # Behind a load balancer: the conversation's turns alternate between the gateways.
        through = (index + turn) % len(gateways)
        gateway = gateways[through]
        idle = [i for i, n in enumerate(result.active_samples[-1]) if n == 0] if result.active_samples else []
        messages.append({"role": "user", "content": text})
        body = {"model": model, "max_tokens": output_tokens, "stream": True, "system": workload.system, "tools": workload.tools, "messages": messages}
        headers = {"x-api-key": key, "anthropic-version": h.ANTHROPIC_VERSION, "content-type": "application/json"}
        if header:
            headers["x-claude-code-session-id"] = session_id
        chosen = None
        if oracle is not None:
            chosen = await oracle.choose(body, index)
            body["model"] = oracle.models[chosen]
            oracle.open[chosen] += 1
        answer: list[str] = []
        started = time.perf_counter()
        first: float | None = None
        try:
            async with client.stream("POST", gateway + "/v1/messages", json=body, headers=headers) as response:
                if response.status_code != 200:
                    result.errors.append(f"{response.status_code} {(await response.aread())[:200]!r}")
                    messages.pop()
                    continue
                request_id = response.headers.get("request-id", "")
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event.get("type") == "error":
                        result.errors.append(f"stream error: {event.get('error')}")
                    if event.get("type") == "content_block_delta":
                        if first is None:
                            first = time.perf_counter() - started
                        answer.append(event["delta"].get("text", ""))
        except httpx.HTTPError as exc:
            # A lost connection is a failed turn, not the end of the benchmark.
            result.errors.append(f"{type(exc).__name__}: {exc}")
            messages.pop()
            continue
        finally:
            if oracle is not None and chosen is not None:
                oracle.open[chosen] -= 1
        if first is not None:
            result.ttft.append(first)
        result.turns += 1
        result.answered.append(Turn(index, turn, through, request_id, first, idle))
        messages.append({"role": "assistant", "content": "".join(answer) or "ok"})


async def sample_active(client: httpx.AsyncClient, sims: list[h.SimProc], result: RunResult, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            answers = await asyncio.gather(*(client.get(s.url + "/sim/stats") for s in sims))
            result.active_samples.append([a.json()["active"] for a in answers])
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass


async def outside_traffic(client: httpx.AsyncClient, sim: h.SimProc, prompt_tokens: int, seed: int, result: RunResult, stop: asyncio.Event) -> None:
    """One outside client: requests straight to the sim (vLLM's chat API, not through any
    gateway), one after another, each with a prompt of its own (no cache hit) until `stop`."""
    rng = random.Random(seed)
    while not stop.is_set():
        body = {"model": "outside", "max_tokens": 16, "messages": [{"role": "user", "content": words(rng, prompt_tokens)}]}
        try:
            await client.post(sim.url + "/v1/chat/completions", json=body)
            result.outside_sent += 1
        except httpx.HTTPError:
            pass


async def wait_engine_queue(client: httpx.AsyncClient, gateways: list[str], sim: h.SimProc, waiting: int, timeout: float = 60.0) -> None:
    """Until every gateway's polled figures show the sim's queue at least `waiting` long."""
    label = f'endpoint="{sim.url}"'
    deadline = time.monotonic() + timeout
    while True:
        seen = []
        for gateway in gateways:
            text = (await client.get(gateway + "/metrics")).text
            line = next((line for line in text.splitlines() if line.startswith("gateway_engine_requests_waiting{") and label in line), "")
            seen.append(float(line.rsplit(" ", 1)[1]) if line else -1.0)
        if min(seen) >= waiting:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateways never saw {sim.url}'s queue at {waiting} (saw {seen})")
        await asyncio.sleep(0.1)


async def drive(
    gateways: list[str], key: str, models: list[str], workload: Workload, sims: Sims, *, header: bool, oracle: bool, output_tokens: int,
    outside_clients: int = 0, outside_prompt_tokens: int = 0,
) -> RunResult:
    result = RunResult()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as client:
        router = Oracle(client, sims.generation, models) if oracle else None
        stop, outside_stop = asyncio.Event(), asyncio.Event()
        outside = [
            asyncio.create_task(outside_traffic(client, sims.generation[0], outside_prompt_tokens, n, result, outside_stop))
            for n in range(outside_clients)
        ]
        if outside and not oracle:
            # Its queue: the outside clients but the one being prefilled (the sims prefill one at a time).
            await wait_engine_queue(client, gateways, sims.generation[0], outside_clients // 2)
        sampler = asyncio.create_task(sample_active(client, sims.generation, result, stop))
        await asyncio.gather(
            *(
                run_session(client, gateways, key, models[0], workload, n, header=header, oracle=router, result=result, output_tokens=output_tokens)
                for n in range(len(workload.sessions))
            )
        )
        stop.set()
        outside_stop.set()
        await asyncio.gather(sampler, *outside)
    return result


def audit_turns(stack: h.Stack, turns: list[Turn], timeout: float = 60.0) -> None:
    """Fill in where the gateways sent each turn, from their audit rows (written after the
    answer, in the background: waited for)."""
    ids = [t.request_id for t in turns if t.request_id]
    code = (
        "import json\n"
        "from messages_api.models import MessageRequest as M\n"
        f"ids = json.loads({json.dumps(json.dumps(ids))})\n"
        "rows = M.objects.filter(request_id__in=ids).exclude(status='in_progress')\n"
        "print(json.dumps({r.request_id: [r.generation_endpoint, r.context_endpoint, r.input_tokens or 0, r.cache_read_input_tokens or 0]"
        " for r in rows}))\n"
    )
    deadline = time.monotonic() + timeout
    while True:
        rows = json.loads(stack.manage("shell", "-c", code).strip().splitlines()[-1])
        if len(rows) >= len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for t in turns:
        if t.request_id in rows:
            t.generation_endpoint, t.context_endpoint, t.input_tokens, t.cached_tokens = rows[t.request_id]


def cache_totals(sims: Sims) -> dict[str, Any]:
    caches = {s.url: h.http_get_json(h.port_of(s.url), "/sim/prefix_cache")[1] for s in sims.all}
    stats = {s.url: h.sim_stats(s.url) for s in sims.all}
    return {
        "computed_tokens": sum(c["computed_tokens"] for c in caches.values()),
        "cached_tokens": sum(c["cached_tokens"] for c in caches.values()),
        "context_requests": sum(stats[s.url]["received"] for s in sims.context),
        "generation_requests": [stats[s.url]["received"] for s in sims.generation],
        "per_sim": [
            {"role": s.role, "received": stats[s.url]["received"], "computed_tokens": caches[s.url]["computed_tokens"],
             "cached_tokens": caches[s.url]["cached_tokens"], "blocks_held": caches[s.url]["blocks_held"]}
            for s in sims.all
        ],
    }


class LazyGateway:
    """The gateway processes for every run (`count`, each on its own port), started once the
    first run's pools exist (their /ready wants a routable pool)."""

    def __init__(self, stack: h.Stack, settings: dict[str, Any], count: int = 1) -> None:
        self.stack = stack
        self.settings = settings
        self.count = count
        self.procs: list[h.GatewayProc] = []

    def ready(self, pools: set[str]) -> list[h.GatewayProc]:
        if not self.procs:
            settings = {"REGISTRY_REFRESH_INTERVAL_S": 0.2, "MESSAGES_PING_INTERVAL_S": 10, **self.settings}
            self.procs = [self.stack.start_gateway(settings, expect_pools=pools) for _ in range(self.count)]
        else:
            for proc in self.procs:
                h.wait_ready(proc, pools)
        return self.procs


def run_policy(
    stack: h.Stack, gateways: LazyGateway, key: str, args: argparse.Namespace, workload: Workload, policy: str, run: int
) -> dict[str, Any]:
    routing, _, variant = policy.partition("+")
    events = variant == "events"
    sims = start_sims(stack, args, events=events)
    try:
        header = variant == "header"
        name = f"s{run}-{routing}-{variant or 'plain'}"
        contexts = [("context", s.url, "", "") for s in sims.context]
        generation = [("generation", g.url, *g.kv_events) for g in sims.generation]  # type: ignore[attr-defined]
        if routing == "oracle":
            pools = [
                {"name": f"{name}-g{i}", "routing": "cache_aware", "limit": args.max_local_prefill, "protocol": args.protocol,
                 "endpoints": [*contexts, g]}
                for i, g in enumerate(generation)
            ]  # fmt: skip
        else:
            pools = [
                {
                    "name": name,
                    "routing": routing,
                    "limit": args.max_local_prefill,
                    "protocol": args.protocol,
                    "endpoints": contexts + generation,
                }
            ]
        create_pools(stack, pools)
        procs = gateways.ready({p["name"] for p in pools})
        started = time.perf_counter()
        result = asyncio.run(
            drive(
                [g.url for g in procs],
                key,
                [p["name"] for p in pools],
                workload,
                sims,
                header=header,
                oracle=routing == "oracle",
                output_tokens=args.output_tokens,
                outside_clients=args.outside_clients,
                outside_prompt_tokens=args.outside_prompt_tokens,
            )
        )
        wall = time.perf_counter() - started
        totals = cache_totals(sims)
        audit_turns(stack, result.answered)
    finally:
        for sim in sims.all:
            sim.stop()
    prefills = totals["computed_tokens"] + totals["cached_tokens"]
    per_endpoint = [sum(sample[i] for sample in result.active_samples) / max(len(result.active_samples), 1) for i in range(4)]
    mean_active = sum(per_endpoint) / 4
    routed = totals["generation_requests"]
    return {
        **turn_figures(result, [g.url for g in sims.generation]),
        "policy": policy,
        "turns": result.turns,
        "errors": result.errors,
        "wall_s": wall,
        "prefill_tokens_computed": totals["computed_tokens"],
        "cached_tokens": totals["cached_tokens"],
        "cache_hit_rate": totals["cached_tokens"] / prefills if prefills else 0.0,
        "context_phases_skipped": result.turns - totals["context_requests"],
        "ttft_s": h.distribution(result.ttft),
        "open_requests_per_generation_endpoint": per_endpoint,
        "load_imbalance": max(per_endpoint) / mean_active if mean_active else float("nan"),
        "requests_per_generation_endpoint": routed,
        "routed_imbalance": max(routed) / (sum(routed) / 4) if sum(routed) else float("nan"),
        "per_sim": totals["per_sim"],
    }


def turn_figures(result: RunResult, generation: list[str]) -> dict[str, Any]:
    """Per turn, from the audit rows: context phases run and cached tokens by turn number (first
    turns apart), and where new conversations went (the first generation sim takes the outside
    traffic, if any)."""
    later = [t for t in result.answered if t.turn > 0]
    firsts = [t for t in result.answered if t.turn == 0]
    by_endpoint = [sum(t.generation_endpoint == url for t in firsts) for url in generation]
    # New conversations sent while another generation sim had nothing open.
    while_idle = [t for t in firsts if any(i != 0 for i in t.idle_elsewhere)]
    return {
        "outside_requests": result.outside_sent,
        "first_turns_per_generation_endpoint": by_endpoint,
        "first_turns_to_busy_share": by_endpoint[0] / len(firsts) if firsts else float("nan"),
        "first_turns_while_another_idle": len(while_idle),
        "first_turns_to_busy_while_another_idle": sum(t.generation_endpoint == generation[0] for t in while_idle),
        "context_phases_first_turns": sum(bool(t.context_endpoint) for t in firsts),
        "context_phases_later_turns": sum(bool(t.context_endpoint) for t in later),
        "later_turns": len(later),
        "cached_tokens_reported_later_turns": sum(t.cached_tokens for t in later),
        # [session, turn, gateway, generation sim, context phase ran, input tokens, cached tokens, TTFT s]
        "per_turn": [
            [t.session, t.turn, t.gateway, generation.index(t.generation_endpoint) if t.generation_endpoint in generation else -1,
             bool(t.context_endpoint), t.input_tokens, t.cached_tokens, t.ttft]
            for t in sorted(result.answered, key=lambda t: (t.session, t.turn))
        ],
    }


# --- the index's own cost ---------------------------------------------------------------------------


def longest_chat(workload: Workload) -> dict[str, Any]:
    """The OpenAI chat body of the workload's longest session's last turn."""
    longest = max(range(len(workload.sessions)), key=lambda n: sum(len(t) for t, _ in workload.sessions[n]))
    messages: list[dict[str, Any]] = []
    for text, _ in workload.sessions[longest]:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return to_chat_request({"model": "m", "max_tokens": 1, "system": workload.system, "tools": workload.tools, "messages": messages[:-1]})


def index_marks(workload: Workload, args: argparse.Namespace) -> tuple[int, float]:
    """PREFIX_INDEX_CHUNKS_PER_ENDPOINT sized like the sims' caches, and the rendered bytes per
    sim token it assumed."""
    from workers.routing.prefix_index import Prompt
    from workers.schedule.rendered_chat import RenderedChat
    from workers.sim.tokenizer import tokenize_chat

    chat = longest_chat(workload)
    bytes_per_token = Prompt(RenderedChat(chat), args.index_chunk_bytes).size / len(tokenize_chat(chat["messages"], chat.get("tools")))
    if args.index_marks:
        return args.index_marks, bytes_per_token
    return int(args.kv_cache_tokens * bytes_per_token / args.index_chunk_bytes) + args.sessions, bytes_per_token


def index_cost(workload: Workload, chunk_bytes: int, sessions: int = 10000) -> dict[str, Any]:
    """CPU of one request's whole index work on the largest prompt of the workload, as
    `workers.routing.router` and the pipeline do it on a pool of 4 generation and 2 context endpoints that
    all know the prompt: the key (digests and offsets over the serialized prompt), the generation
    matches, the chosen one's held match, recording it and confirming it on the first token; with a
    context phase, also the context matches, recording and confirming the context endpoint. The
    prompt's serialization (`RenderedChat`) is not counted: the request does it with or without the
    index, once, for its worker bodies; its cost is reported apart (`render_us`).
    Best of 15 rounds of 200, the variants interleaved (the machine is shared); page faults
    counted alongside. Then the index's memory with `sessions` conversations of that shape."""
    from workers.routing.prefix_index import PrefixIndex, Prompt
    from workers.schedule.rendered_chat import RenderedChat

    chat = longest_chat(workload)
    rendered = RenderedChat(chat)
    index = PrefixIndex(16384, 1800.0)
    prompt = Prompt(rendered, chunk_bytes)
    for endpoint in range(6):
        index.record(endpoint, "p", prompt.key)
        index.confirm(endpoint, prompt.key)

    def skipped() -> None:
        prompt = Prompt(rendered, chunk_bytes)
        matches = index.matches(range(4), prompt)
        index.held(1, prompt, sent=matches[1])
        index.record(1, "p", prompt.key)
        index.confirm(1, prompt.key)

    def with_context() -> None:
        prompt = Prompt(rendered, chunk_bytes)
        matches = index.matches(range(4), prompt)
        index.held(1, prompt, sent=matches[1])
        index.record(1, "p", prompt.key)
        index.matches((4, 5), prompt)
        index.record(4, "p", prompt.key, conversation=False)
        index.confirm(4, prompt.key)
        index.confirm(1, prompt.key)

    work = {
        "key": lambda: Prompt(rendered, chunk_bytes),
        "skipped": skipped,
        "with_context": with_context,
        "render": lambda: RenderedChat(chat),
    }
    best = dict.fromkeys(work, float("inf"))
    # Page faults are counted too: on this VM one costs ~3.5 µs, and glibc returning freed
    # prompt-sized buffers to the kernel (heap trimming) can fault ~60-80 pages per call back in,
    # by the heap's history as much as by the code measured.
    faults = dict.fromkeys(work, 0)
    for _ in range(15):
        for name, run in work.items():
            started, faulted = time.process_time_ns(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(200):
                run()
            best[name] = min(best[name], (time.process_time_ns() - started) / 200 / 1000)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted
    # Memory: 10,000 live sessions on 4 endpoints, each its own conversation after the shared head,
    # none evicted (no LRU bound): what the index costs if it holds them all.
    tracemalloc.start()
    big = PrefixIndex(2**62, 1800.0)
    rng = random.Random(1)
    head = list(prompt.key.marks[:2])
    tail = len(prompt.key.marks) - len(head)
    for n in range(sessions):
        marks = tuple(head + [rng.getrandbits(64) for _ in range(tail)])
        big.record(n % 4, "p", type(prompt.key)(marks, prompt.size))
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "prompt_bytes": prompt.size,
        "marks": len(prompt.key.marks),
        "chunk_bytes": chunk_bytes,
        "key_us": best["key"],
        "render_us": best["render"],
        "cpu_us_per_request": best["skipped"],
        "cpu_us_per_request_with_context": best["with_context"],
        "minor_faults_per_call": {name: count / (15 * 200) for name, count in faults.items()},
        "index_mib_at_sessions": memory / 2**20,
        "sessions": sessions,
        "marks_held": big.marks_held(),
    }


# --- main -------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    workload = build_workload(args)
    turns = sum(len(s) for s in workload.sessions)
    marks, bytes_per_token = index_marks(workload, args)
    print(f"{args.sessions} sessions, {turns} turns, shared prefix ~{args.system_tokens} tokens, "
          f"prefill {args.prefill_rate:.0f} tokens/s per uncached token, cache {args.kv_cache_tokens} tokens per sim; "
          f"gateway index: {args.index_chunk_bytes}-byte chunks, {marks} marks per endpoint "
          f"({bytes_per_token:.2f} rendered bytes per sim token)")
    results: list[dict[str, Any]] = []
    with h.Stack("sessions", keep=args.keep) as stack:
        stack.migrate()
        key = stack.create_api_key()
        note = h.wait_for_quiet(args.quiet_wait)
        settings: dict[str, Any] = {"PREFIX_INDEX_CHUNK_BYTES": args.index_chunk_bytes, "PREFIX_INDEX_CHUNKS_PER_ENDPOINT": marks}
        if args.gateways > 1:
            # Shared by the gateway processes (learned prompts, limits, engine-load leases), apart
            # from every other user of this Redis.
            settings |= {
                "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                "REDIS_KEY_PREFIX": f"bench-sessions-{os.getpid()}-{time.time_ns()}:",
            }
        if args.engine_load_poll:
            settings |= {"ENGINE_LOAD_POLL_S": args.engine_load_poll, "ENGINE_LOAD_MAX_AGE_S": max(5.0, 4 * args.engine_load_poll)}
        settings |= dict(item.split("=", 1) for item in args.gateway_setting)
        gateways = LazyGateway(stack, settings, args.gateways)
        started = h.machine_busy_seconds(), time.perf_counter()
        for run, policy in enumerate(args.policies):
            print(f"running {policy} ...", flush=True)
            result = run_policy(stack, gateways, key, args, workload, policy, run)
            results.append(result)
            ttft = result["ttft_s"]
            print(f"  {result['turns']} turns, {result['prefill_tokens_computed']:,} prefill tokens, hit {result['cache_hit_rate'] * 100:.1f} %, "
                  f"{result['context_phases_skipped']} context phases skipped, TTFT p50 {ttft.get('p50', float('nan')) * 1000:.0f} ms, "
                  f"imbalance {result['load_imbalance']:.2f}, {len(result['errors'])} errors, {result['wall_s']:.0f} s", flush=True)
            print(f"  context phases: {result['context_phases_first_turns']} of first turns, {result['context_phases_later_turns']} of "
                  f"{result['later_turns']} later turns; first turns per generation sim {result['first_turns_per_generation_endpoint']}"
                  + (f"; outside traffic {result['outside_requests']} requests to sim 0, new conversations to it "
                     f"{result['first_turns_to_busy_share'] * 100:.0f} % (while another was idle: "
                     f"{result['first_turns_to_busy_while_another_idle']} of {result['first_turns_while_another_idle']})"
                     if args.outside_clients else ""), flush=True)
            # Kept as it goes: a long run that fails late keeps what it measured.
            h.write_result(h.result_name(args, "sessions") + "-partial", {"args": vars(args), "results": results})
        gateway_cpu = sum(h.proc_cpu_seconds(g.pid) for g in gateways.procs)
        busy = (h.machine_busy_seconds() - started[0]) / ((time.perf_counter() - started[1]) * (os.cpu_count() or 1))
        machine = f"machine {busy * 100:.0f}% busy over the runs"
    cost = index_cost(workload, args.index_chunk_bytes)

    baseline = next((r for r in results if r["policy"] == "round_robin"), None)
    oracle = next((r for r in results if r["policy"] == "oracle"), None)
    rows = []
    for r in results:
        ttft = r["ttft_s"]
        rows.append([
            r["policy"],
            r["turns"],
            r["prefill_tokens_computed"],
            (r["prefill_tokens_computed"] / baseline["prefill_tokens_computed"])
            if baseline and baseline["prefill_tokens_computed"] else float("nan"),
            r["cache_hit_rate"] * 100,
            (r["cache_hit_rate"] / oracle["cache_hit_rate"] * 100) if oracle and oracle["cache_hit_rate"] else float("nan"),
            r["context_phases_skipped"],
            ttft.get("p50", float("nan")) * 1000,
            ttft.get("p99", float("nan")) * 1000,
            r["load_imbalance"],
            r["routed_imbalance"],
            len(r["errors"]),
        ])
    h.print_table(
        f"Sessions ({machine}; {note})",
        ["policy", "turns", "prefill tok", "vs RR", "hit %", "% of oracle", "ctx skipped",
         "TTFT p50 ms", "TTFT p99 ms", "imbalance", "routed max/mean", "errors"],
        rows,
    )
    print(f"\nprefix index, in-process, on a {cost['prompt_bytes']:,}-byte prompt ({cost['marks']} marks of "
          f"{cost['chunk_bytes']:,}-byte chunks): {cost['cpu_us_per_request']:.1f} µs CPU per request skipping the context "
          f"phase, {cost['cpu_us_per_request_with_context']:.1f} µs with one (of which the key {cost['key_us']:.1f} µs; "
          f"not counted, the prompt's one serialization for the worker bodies: {cost['render_us']:.1f} µs); "
          f"{cost['index_mib_at_sessions']:.1f} MiB for {cost['sessions']:,} sessions ({cost['marks_held']:,} marks held, none evicted); "
          f"page faults per call {', '.join(f'{k} {v:.1f}' for k, v in cost['minor_faults_per_call'].items())}")
    print(f"gateway CPU for all runs: {gateway_cpu:.1f} s")
    for r in results:
        for error in r["errors"][:3]:
            print(f"  {r['policy']} error: {error}")
    h.write_result(
        h.result_name(args, "sessions"),
        {
            "args": vars(args),
            "index_marks_per_endpoint": marks,
            "bytes_per_token": bytes_per_token,
            "machine_note": machine,
            "quiet": note,
            "results": results,
            "index_cost": cost,
            "gateway_cpu_s": gateway_cpu,
        },
    )


if __name__ == "__main__":
    main()
