"""A generation worker starved of CPU while it serves: do live workers' requests get "no generation
worker is available"? (issue 42, part 4: three such answers in a loaded soak.)

    .venv/bin/python bench/starved_worker.py                    # this checkout
    .venv/bin/python bench/starved_worker.py --root /tmp/old    # another checkout, same world

Starvation without loading the shared machine: the generation sim is stopped (SIGSTOP) for
--stop s out of every --stop + --run s, so it serves at a fraction of its speed, as a process
that gets a share of a core among many; its /health answers late whenever a probe lands in a
stop. `--starve gateway` stops the gateway instead: its own loop is then late, the workers not.
The gateway probes with the defaults (every 5 s, 2 s timeout, unhealthy after 3), the soak's
settings otherwise (breakers out of the way). --clients loops send short streamed
requests one after another for --seconds.

Prints the answers by status and message, the gateway's health lines, and how late the sim's
/health was as a separate client saw it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402  (puts the project on the path)
import httpx  # noqa: E402
from soak import GATEWAY_ENV, Client, Scenario  # noqa: E402


class Starver(threading.Thread):
    """Stops and resumes a process in a duty cycle until told to end (and leaves it running)."""

    def __init__(self, pid: int, stop_s: float, run_s: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self.ended = threading.Event()

    def run(self) -> None:
        try:
            while not self.ended.wait(self.run_s):
                os.kill(self.pid, signal.SIGSTOP)
                self.ended.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
        finally:
            os.kill(self.pid, signal.SIGCONT)


def health_latencies(url: str, until: float) -> list[float]:
    seen = []
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            httpx.get(url + "/health", timeout=30)
        except httpx.HTTPError:
            continue
        seen.append(time.monotonic() - started)
        time.sleep(0.5)
    return seen


async def load(port: int, key: str, model: str, clients: int, seconds: float) -> Counter[str]:
    client = Client(port, key)
    answers: Counter[str] = Counter()
    stop_at = time.monotonic() + seconds

    async def user(n: int) -> None:
        rng = random.Random(n)
        await asyncio.sleep(rng.uniform(0, 2))
        while time.monotonic() < stop_at:
            result = await client.run(Scenario("ok", "sim", f"hi [sim tokens={rng.randint(5, 30)}]"), model, rng)
            answers[f"{result.status} {result.end} {result.error_type}".strip()] += 1

    await asyncio.gather(*(user(n) for n in range(clients)))
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--stop", type=float, default=2.5, help="seconds the generation sim is stopped each cycle")
    parser.add_argument("--run", type=float, default=1.0, help="seconds it runs between stops")
    parser.add_argument(
        "--starve", choices=["generation", "gateway"], default="generation",
        help="the process stopped in the duty cycle: the generation sim (its /health late), or the gateway (its own loop late)",
    )
    parser.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE", help="a gateway setting (repeatable)")
    parser.add_argument("--root", type=Path, help="run the gateway from another checkout (an A/B on the same world)")
    args = h.parse_args(parser, quick={"clients": 10, "seconds": 20.0}, full={})
    with h.Stack("starved-worker", keep=args.keep) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=100, prefill_tokens_per_second=100000, kv_timeout=30)
        for role, url in (("context", ctx.url), ("generation", gen.url)):
            stack.register_worker("starved", "starved-model", role, url, schedule_style="context_first")
        key = stack.create_api_key("starved")
        env = {**GATEWAY_ENV, "HEALTH_CHECK_INTERVAL_S": "5", "HEALTH_CHECK_TIMEOUT_S": "2", "HEALTH_UNHEALTHY_AFTER": "3"}
        env.update(setting.split("=", 1) for setting in args.setting)
        gateway = stack.start_gateway(env, expect_pools=["starved"], root=args.root)
        starver = Starver(gen.pid if args.starve == "generation" else gateway.pid, args.stop, args.run)
        starver.start()
        latencies: list[float] = []
        prober = threading.Thread(target=lambda: latencies.extend(health_latencies(gen.url, time.monotonic() + args.seconds)))
        prober.start()
        answers = asyncio.run(load(gateway.port, key, "starved-model", args.clients, args.seconds))
        starver.ended.set()
        starver.join()
        prober.join()
        log = gateway.log_path.read_text(errors="replace")
    root = args.root or "this checkout"
    print(f"\nstarved: the {args.starve} process (stopped {args.stop} s of every {args.stop + args.run} s), gateway from {root}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    for answer, n in answers.most_common():
        print(f"  {n:6d}  {answer}")
    no_worker = log.count("worker is available")
    print(f"gateway log: 'is now unhealthy' {log.count('is now unhealthy')}, 'is now healthy' {log.count('is now healthy')}, "
          f"'no ... worker is available' answers {no_worker}, routed despite probes (episodes) {log.count('despite their probes')}")
    latencies.sort()
    if latencies:
        print(
            f"sim /health seen by another client: n={len(latencies)} p50={latencies[len(latencies) // 2]:.2f} s "
            f"p90={latencies[int(len(latencies) * 0.9)]:.2f} s max={latencies[-1]:.2f} s, over 2 s: {sum(x > 2 for x in latencies)}"
        )


if __name__ == "__main__":
    main()
