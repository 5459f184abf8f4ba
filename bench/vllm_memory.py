"""Memory of the real engine as CI runs it: is the real-vLLM part of CI within 4 GB of RAM?

    make vllm
    .venv/bin/python bench/vllm_memory.py [--pair] [--extra-arg=--max-num-batched-tokens=8192]

Starts the server tests/support/realvllm/server.py starts (the tiny model, the test window), sends it one
streamed request of the Claude Code fixture's size (the largest prompt the tests send), and
samples the proportional set size (PSS, so pages shared between the API server and its engine
core process count once) of the server's whole process tree every 0.1 s: the peak during start-up
(vLLM profiles a forward pass of `max_num_batched_tokens` tokens to size its KV cache), the
steady size once healthy, and the peak while serving. `--pair` does the same for the
prefill/decode pair tests/realengine/test_vllm_pd_real.py starts (tests/support/realvllm/pd.py).

Not gating (prints a table, writes bench/results/vllm_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import write_result  # noqa: E402
from tests.support.realvllm.pd import start_pair  # noqa: E402
from tests.support.realvllm.server import RealVllm, missing  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "claude_code_request.json"


def tree_pids(root: int) -> list[int]:
    """`root` and every descendant, from /proc (vLLM's engine core is a child process)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def pss_mib(pids: list[int]) -> float:
    total_kib = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
                    break
        except OSError:
            continue
    return total_kib / 1024


class PssSampler:
    """The PSS of several process trees together, sampled on a thread; `mark()` starts a new phase."""

    def __init__(self, roots: list[int], interval: float = 0.1) -> None:
        self.roots = roots
        self.interval = interval
        self.phases: dict[str, list[float]] = {}
        self._phase = "start-up"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self, phase: str) -> None:
        self._phase = phase

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = [pid for root in self.roots for pid in tree_pids(root)]
            self.phases.setdefault(self._phase, []).append(pss_mib(pids))
            self._stop.wait(self.interval)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            phase: {"peak_mib": round(max(values), 1), "last_mib": round(values[-1], 1), "samples": len(values)}
            for phase, values in self.phases.items()
            if values
        }


def serve_one(server: RealVllm, max_tokens: int) -> float:
    """One streamed request, the Claude Code fixture as the gateway converts it; returns its seconds."""
    from messages_api.convert import to_chat_request

    chat = to_chat_request({**json.loads(FIXTURE.read_text())["body"], "max_tokens": max_tokens})
    chat.update(model=server.model, stream=True)
    started = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=300) as answer:
        answer.raise_for_status()
        for _ in answer.iter_bytes():
            pass
    return time.monotonic() - started


def measure(pair: bool, extra_args: list[str], max_tokens: int) -> dict[str, Any]:
    if pair:
        # start_pair launches both at once and waits: sample from before either exists by
        # sampling this process's tree (the servers are its children; this process adds ~60 MiB).
        with PssSampler([os.getpid()]) as sampler:
            prefill, decode = start_pair(progress_thread=False)
            try:
                sampler.mark("healthy, idle")
                time.sleep(3)
                sampler.mark("serving")
                seconds = serve_one(decode, max_tokens)
            finally:
                prefill.stop()
                decode.stop()
        return {"servers": 2, "request_s": round(seconds, 2), "pss": sampler.summary()}
    server = RealVllm(*extra_args, name="memory").launch()
    assert server.process is not None
    try:
        with PssSampler([server.process.pid]) as sampler:
            server.wait_healthy()
            sampler.mark("healthy, idle")
            time.sleep(3)
            sampler.mark("serving")
            seconds = serve_one(server, max_tokens)
    finally:
        server.stop()
    return {
        "servers": 1,
        "extra_args": extra_args,
        "startup_s": round(server.startup_seconds, 1),
        "request_s": round(seconds, 2),
        "pss": sampler.summary(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", action="store_true", help="the prefill/decode pair instead of one server")
    parser.add_argument("--extra-arg", action="append", default=[], help="an extra vLLM argument (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if reason := missing():
        print(f"skipped: {reason}")
        return 1
    result = measure(args.pair, args.extra_arg, args.max_tokens)
    print(f"{'phase':<16} {'peak PSS MiB':>13} {'last MiB':>9}")
    for phase, values in result["pss"].items():
        print(f"{phase:<16} {values['peak_mib']:>13} {values['last_mib']:>9}")
    print(f"request: {result['request_s']} s")
    write_result("vllm_memory" + ("_pair" if args.pair else ""), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
