"""The command-line options every benchmark script shares, and their --quick or full defaults."""

from __future__ import annotations

import argparse
from typing import Any


def add_common_arguments(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help="a small run that finishes in seconds (smoke test)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (database, logs)")
    parser.add_argument(
        "--gateway-nodelay",
        action="store_true",
        help="set TCP_NODELAY on daphne's listening socket (daphne leaves Nagle on; off by default, as deployed)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample the gateway with py-spy during the run (bench/results/<name>-gateway.txt: collapsed "
        "stacks, and a summary printed at the end), at BENCH_PROFILE_RATE samples per second (default 250); "
        "needs `.venv/bin/pip install py-spy`",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before measuring, wait up to this many seconds for the machine to be idle "
        "(default 60; 0 with --quick)",
    )
    parser.add_argument("--name", help="result file name (default: the script's name, '-quick' appended with --quick)")


def result_name(args: Any, default: str) -> str:
    if args.name:
        return str(args.name)
    return default + ("-quick" if args.quick else "")


def resolve(args: Any, quick: dict[str, Any], full: dict[str, Any]) -> None:
    """Options left at None take their --quick or full default."""
    if getattr(args, "quiet_wait", None) is None:
        args.quiet_wait = 0.0 if args.quick else 60.0
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def parse_args(parser: argparse.ArgumentParser, *, quick: dict[str, Any], full: dict[str, Any]) -> argparse.Namespace:
    """The script's options with the common ones added, those left unset at their --quick or full
    defaults (`resolve`)."""
    add_common_arguments(parser)
    args = parser.parse_args()
    resolve(args, quick, full)
    return args
