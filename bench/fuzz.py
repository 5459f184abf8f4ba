"""Fuzz a gateway with N hostile requests (default 10,000) and count what must never happen.

The generators are tests/support/hostile.py's (the same ones tests/e2e/test_fuzz.py runs under pytest):
random JSON in every field of a valid request, wrong types, deep nesting, huge strings, invalid
UTF-8, bad headers, unknown paths under /v1/, wrong methods. Each request goes on its own socket;
the answer must be below 500, in Anthropic's envelope (or a valid message or stream) and complete
within --timeout. Counted: 5xx, non-envelope answers, connections closed without an answer, hangs.
Target (issue 9): 0 of each.

    .venv/bin/python bench/fuzz.py                  # 10,000 requests (~5 min)
    .venv/bin/python bench/fuzz.py --quick          # 300 requests
    .venv/bin/python bench/fuzz.py --requests 2000 --concurrency 8 --seed 1

Prints counts per category and per request kind, up to --examples findings per category, and
writes bench/results/fuzz.json. The gateway's RSS is sampled before and after.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402  (puts the project on the path)
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests.support import hostile  # noqa: E402

CATEGORIES = ("hang", "no_answer", "5xx", "non_envelope")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, help="N requests (default 10000; --quick 300)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before an answer counts as a hang")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0: reproducible)")
    parser.add_argument("--examples", type=int, default=5, help="findings printed per category")
    parser.add_argument("--database-url", help="default: a new SQLite file in a temporary directory")
    args = h.parse_args(parser, quick={"requests": 300}, full={"requests": 10_000})
    return args


class Tally:
    """Counts and a few examples per category, shared by the sender threads."""

    def __init__(self, examples: int) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.by_category: Counter[str] = Counter()
        self.by_kind: Counter[str] = Counter()
        self.bad_by_kind: Counter[str] = Counter()
        self.statuses: Counter[int | None] = Counter()
        self.findings: dict[str, list[dict[str, Any]]] = {c: [] for c in CATEGORIES}
        self.examples = examples
        self.seconds: list[float] = []

    def add(self, request: hostile.HostileRequest, answer: hostile.Answer) -> None:
        category, detail = hostile.problem(request, answer)
        kind = request.kind.split(":")[0]
        with self.lock:
            self.sent += 1
            self.by_kind[kind] += 1
            self.statuses[answer.status] += 1
            self.seconds.append(answer.seconds)
            if category:
                self.by_category[category] += 1
                self.bad_by_kind[f"{category}/{request.kind}"] += 1
                if len(self.findings[category]) < self.examples:
                    self.findings[category].append({"detail": detail, "request": request.describe()})


def run(args: argparse.Namespace, port: int, key: str, model: str, tally: Tally) -> None:
    """Hypothesis generates in this thread; `--concurrency` threads send."""
    pending: queue.Queue[hostile.HostileRequest | None] = queue.Queue(maxsize=args.concurrency * 4)

    def sender() -> None:
        while (request := pending.get()) is not None:
            tally.add(request, hostile.send("127.0.0.1", port, request, args.timeout))

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()

    @seed(args.seed)
    @settings(
        max_examples=args.requests,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(hostile.any_request(key, model))
    def generate(request: hostile.HostileRequest) -> None:
        pending.put(request)

    generate()
    for _ in threads:
        pending.put(None)
    for thread in threads:
        thread.join()


def main() -> None:
    args = parse_args()
    run_id = time.strftime("%Y%m%d%H%M%S")
    pool, model = f"fuzz-{run_id}", f"sim-model-{run_id}"
    tally = Tally(args.examples)
    with h.Stack("fuzz", database_url=args.database_url, keep=args.keep) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=2000, prefill_tokens_per_second=200000, max_context_tokens=4096)
        for role, sim in (("context", ctx), ("generation", gen)):
            stack.register_worker(pool, model, role, sim.url, schedule_style="context_first")
        key = stack.create_api_key(f"fuzz-{run_id}")
        # A body that never fully arrives is the gateway's to cut, well before our --timeout.
        gateway = stack.start_gateway({"AUDIT_FLUSH_INTERVAL_S": "0.05", "MESSAGES_BODY_READ_TIMEOUT_S": "5"}, expect_pools=[pool])
        h.wait_for_quiet(args.quiet_wait)
        rss_before = h.rss_mib(gateway.pid)
        started = time.monotonic()
        run(args, gateway.port, key, model, tally)
        elapsed = time.monotonic() - started
        alive = gateway.process.poll() is None
        rss_after = h.rss_mib(gateway.pid) if alive else None

    bad = sum(tally.by_category.values())
    h.print_table(
        f"fuzz: {tally.sent} requests in {elapsed:.0f} s ({tally.sent / elapsed:.0f}/s), concurrency {args.concurrency}",
        ["category", "count", "target"],
        [[c, tally.by_category.get(c, 0), 0] for c in CATEGORIES],
    )
    print(f"requests per kind: {dict(tally.by_kind)}")
    print(f"statuses: {dict(sorted(tally.statuses.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))}")
    if tally.bad_by_kind:
        print(f"findings per category/kind: {dict(tally.bad_by_kind.most_common())}")
    for category, findings in tally.findings.items():
        for finding in findings:
            print(f"  [{category}] {finding['detail'][:300]}\n      {finding['request'][:300]}")
    print(f"gateway alive at the end: {alive}; RSS {rss_before:.0f} → {rss_after if rss_after is None else round(rss_after)} MiB")
    print(f"verdict: {h.verdict(bad == 0 and alive)}")
    h.write_result(
        h.result_name(args, "fuzz"),
        {
            "config": {"requests": args.requests, "concurrency": args.concurrency, "timeout_s": args.timeout, "seed": args.seed},
            "sent": tally.sent,
            "elapsed_s": elapsed,
            "by_category": {c: tally.by_category.get(c, 0) for c in CATEGORIES},
            "by_kind": dict(tally.by_kind),
            "findings_by_kind": dict(tally.bad_by_kind),
            "statuses": {str(k): v for k, v in tally.statuses.items()},
            "findings": tally.findings,
            "answer_seconds": h.distribution(tally.seconds),
            "gateway_alive": alive,
            "rss_mib": {"before": rss_before, "after": rss_after},
            "ok": bad == 0 and alive,
        },
    )


if __name__ == "__main__":
    main()
