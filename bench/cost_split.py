#!/usr/bin/env python
"""A paced relay's CPU split into what each token costs and what each request costs.

    .venv/bin/python bench/cost_split.py                        # 10,000 ev/s, 64- and 1024-token streams
    .venv/bin/python bench/cost_split.py --load 2500 --short 32 --long 512 --seconds 20

`bench/relay.py --part paced` reports CPU µs per relayed event at one stream length (256 tokens),
which mixes two costs a change moves differently: the per-token path (worker read → client write)
and the per-request path (parsing, routing, the worker request, the audit row, the response's
start and end). This runs the paced level twice, with short and with long streams, at the same
offered load and pace (so the same number of concurrent streams), gateway and floor proxy
(bench/floor_proxy.py, reframe) alike, and solves

    CPU seconds = per_token × events + per_request × streams

over the two runs (each run's events and streams are what its clients counted, partial streams
included). Prints per-token µs, per-request µs, and what per-request work adds per event at 256
tokens; writes bench/results/cost_split.json. About 5 minutes at the defaults.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402

RELAY = Path(__file__).resolve().parent / "relay.py"
TARGETS = {"gateway": "gateway", "floor reframe": "floor"}
# The paced benchmark's stream length (relay.py --paced-tokens): per-request µs are also shown per event at it.
REFERENCE_TOKENS = 256


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", type=int, default=10_000, help="offered events/s (default 10,000)")
    parser.add_argument("--short", type=int, default=64, help="tokens per stream, short run (default 64)")
    parser.add_argument("--long", type=int, default=1024, help="tokens per stream, long run (default 1024)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per run and target (default 20)")
    parser.add_argument("--ms-per-token", type=float, default=20.0, help="the pace per stream (default 20)")
    return parser.parse_args()


def run_level(args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    """One `relay.py --part paced` level with the floor beside the gateway: its JSON result."""
    name = f"cost_split_{tokens}"
    subprocess.run(
        [sys.executable, str(RELAY), "--part", "paced", "--paced-loads", str(args.load), "--paced-tokens", str(tokens),
         "--paced-seconds", str(args.seconds), "--ms-per-token", str(args.ms_per_token), "--floors", "reframe",
         "--name", name],
        check=True,
    )
    result: dict[str, Any] = json.loads((h.RESULTS_DIR / f"{name}.json").read_text())
    level: dict[str, Any] = result["paced"]["levels"][0]
    return level


def split(short: dict[str, Any], long: dict[str, Any], process: str) -> tuple[float, float]:
    """(per-token µs, per-request µs) from two runs' CPU seconds, events and streams."""
    # cpu = t × events + r × streams, twice: Cramer's rule.
    e1, s1, c1 = short["events"], short["streams_run"], short["cpu_s"][process]
    e2, s2, c2 = long["events"], long["streams_run"], long["cpu_s"][process]
    det = e1 * s2 - e2 * s1
    if not det:
        raise RuntimeError("the two runs are proportional: nothing to separate")
    per_token = (c1 * s2 - c2 * s1) / det
    per_request = (e1 * c2 - e2 * c1) / det
    return per_token * 1e6, per_request * 1e6


def main() -> None:
    args = parse_args()
    short, long = run_level(args, args.short), run_level(args, args.long)
    rows, out = [], {}
    for label, process in TARGETS.items():
        per_token, per_request = split(short[label], long[label], process)
        out[label] = {"per_token_us": per_token, "per_request_us": per_request,
                      "runs": {str(args.short): short[label]["proxy_cpu_us_per_event"],
                               str(args.long): long[label]["proxy_cpu_us_per_event"]}}
        rows.append([label, short[label]["proxy_cpu_us_per_event"], long[label]["proxy_cpu_us_per_event"],
                     per_token, per_request, per_request / REFERENCE_TOKENS])
    h.print_table(
        f"CPU split at {args.load:,} ev/s offered, one token every {args.ms_per_token:g} ms per stream",
        ("", f"µs/event, {args.short}-token", f"µs/event, {args.long}-token", "per token µs", "per request µs",
         f"per request, per event at {REFERENCE_TOKENS}"),
        rows, digits=1,
    )
    h.write_result("cost_split", {
        "config": {"load": args.load, "short": args.short, "long": args.long, "seconds": args.seconds,
                   "ms_per_token": args.ms_per_token},
        "targets": out,
    })


if __name__ == "__main__":
    main()
