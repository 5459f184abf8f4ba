#!/usr/bin/env python
"""Hostile uploads without an API key: the gateway's memory and how soon each is cut.

    .venv/bin/python bench/uploads.py            # 4 × 400 MB declared, 4 × 400 MB chunked, 4 slow (~1 min)
    .venv/bin/python bench/uploads.py --quick    # 4 × 40 MB, read timeout 3 s (seconds)

Three phases against one daphne process (the gateway's default 32 MiB body limit):

- declared: C parallel `POST /v1/messages` with `content-length: SIZE`, the body written at full
  speed right after the headers (not waiting for an answer, as a hostile client does);
- chunked: C parallel uploads with `transfer-encoding: chunked`, 1 MiB chunks, no length;
- slow: C uploads at 1 byte/s (`content-length: 1000`), cut after MESSAGES_BODY_READ_TIMEOUT_S;
- with `--under-limit`, a fourth: C bodies of 1 KiB under the limit, sent whole, which the guard
  lets through (the consumer answers 401): what a body the gateway accepts costs while daphne
  queues it and the consumer joins it (not part of the target).

Every client reads the answer while it is still writing. Reported per phase: the statuses, the
seconds from connecting to the answer, the bytes written before the gateway's answer and before
the connection ended; for the gateway: RSS before the phase, its peak during the phase (sampled
every 20 ms from /proc) and after it. Target: RSS growth ≤ 64 MiB over the whole run (issue 9).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h  # noqa: E402
from tests.support.chunked import LAST_CHUNK, chunk  # noqa: E402  (harness puts the project on the path)

RSS_GROWTH_TARGET_MIB = 64
SEND_BLOCK = 1024 * 1024
UNDER_LIMIT = 32 * 1024 * 1024 - 1024  # the gateway's default MESSAGES_MAX_BODY_BYTES, less 1 KiB


@dataclass
class Upload:
    status: int | None = None
    error_type: str | None = None
    answered_at: float | None = None  # seconds from connecting
    sent_before_answer: int = 0
    sent_total: int = 0
    ended_at: float | None = None
    send_error: str | None = None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=4, help="parallel uploads per phase (default 4)")
    parser.add_argument("--size", type=int, help="bytes per upload (default 400 MB; --quick 40 MB)")
    parser.add_argument("--read-timeout", type=float, help="MESSAGES_BODY_READ_TIMEOUT_S (default 30; --quick 3)")
    parser.add_argument("--under-limit", action="store_true", help="also send bodies just under the 32 MiB limit")
    args = h.parse_args(parser, quick={"size": 40_000_000, "read_timeout": 3.0}, full={"size": 400_000_000, "read_timeout": 30.0})
    return args


def head(length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (
        f"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"anthropic-version: {h.ANTHROPIC_VERSION}\r\n{framing}\r\n\r\n"
    ).encode()


def upload(port: int, size: int, mode: str, result: Upload) -> None:
    """One client: a writer thread sends the body, this thread reads the answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.monotonic()
    answered = threading.Event()

    def write() -> None:
        try:
            if mode == "slow":
                sock.sendall(head(size))
                for _ in range(size):
                    if answered.wait(1.0):  # one byte a second, until the gateway answers
                        return
                    sock.sendall(b"x")
                    result.sent_total += 1
                return
            sock.sendall(head(size if mode == "declared" else None))
            block = b"x" * SEND_BLOCK
            if mode == "chunked":
                block = chunk(block)
            sent = 0
            while sent < size:
                part = block if mode == "chunked" or size - sent >= SEND_BLOCK else block[: size - sent]
                sock.sendall(part)
                sent += min(SEND_BLOCK, size - sent)
                result.sent_total = sent
            if mode == "chunked":
                sock.sendall(LAST_CHUNK)
        except OSError as exc:
            result.send_error = type(exc).__name__

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    data = b""
    sock.settimeout(max(120.0, size / 1e6))
    try:
        while True:
            received = sock.recv(65536)
            if not received:
                break
            data += received
            if result.status is None and b"\r\n\r\n" in data:
                result.answered_at = time.monotonic() - started
                result.sent_before_answer = result.sent_total
                result.status = int(data.split(b" ", 2)[1])
                answered.set()
    except OSError:
        pass
    answered.set()
    result.ended_at = time.monotonic() - started
    if b"\r\n\r\n" in data:
        # The JSON object of the answer, whether framed by content-length or chunked.
        body = data.split(b"\r\n\r\n", 1)[1]
        try:
            result.error_type = json.loads(body[body.find(b"{") : body.rfind(b"}") + 1])["error"]["type"]
        except (ValueError, KeyError, TypeError):
            result.error_type = None
    sock.close()
    writer.join(10)


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, h.rss_mib(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> RssSampler:
        self.peak = h.rss_mib(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def run_phase(port: int, pid: int, mode: str, size: int, concurrency: int) -> dict[str, Any]:
    results = [Upload() for _ in range(concurrency)]
    before = h.rss_mib(pid)
    with RssSampler(pid) as sampler:
        threads = [threading.Thread(target=upload, args=(port, size, mode, r)) for r in results]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    after = h.rss_mib(pid)
    return {
        "mode": mode,
        "size": size,
        "rss_before_mib": before,
        "rss_peak_mib": sampler.peak,
        "rss_after_mib": after,
        "uploads": [asdict(r) for r in results],
    }


def main() -> None:
    args = parse_args()
    settings = {"MESSAGES_BODY_READ_TIMEOUT_S": args.read_timeout}
    results: dict[str, Any] = {"config": {"concurrency": args.concurrency, "size": args.size, **settings}, "phases": []}
    with h.Stack("uploads", keep=args.keep) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack)
        for role, sim in (("context", ctx), ("generation", gen)):
            stack.register_worker("bench", h.MODEL, role, sim.url)
        gateway = stack.start_gateway(settings, expect_pools=["bench"])
        results["machine_note"] = h.wait_for_quiet(args.quiet_wait)
        start_rss = h.rss_mib(gateway.pid)
        for mode, size in (("declared", args.size), ("chunked", args.size), ("slow", 1000)):
            results["phases"].append(run_phase(gateway.port, gateway.pid, mode, size, args.concurrency))
        end_rss = h.rss_mib(gateway.pid)
        peak = max(p["rss_peak_mib"] for p in results["phases"])
        if args.under_limit:
            under = run_phase(gateway.port, gateway.pid, "declared", UNDER_LIMIT, args.concurrency)
            under["mode"] = "under-limit"
            results["phases"].append(under)
    growth = peak - start_rss
    results.update({"rss_start_mib": start_rss, "rss_peak_mib": peak, "rss_end_mib": end_rss, "rss_growth_mib": growth})

    rows = []
    for phase in results["phases"]:
        uploads = phase["uploads"]
        rows.append([
            phase["mode"],
            ",".join(sorted({str(u["status"]) for u in uploads})),
            ",".join(sorted({str(u["error_type"]) for u in uploads})),
            max(u["answered_at"] or 0 for u in uploads),
            max(u["sent_before_answer"] for u in uploads) / 1e6,
            max(u["sent_total"] for u in uploads) / 1e6,
            phase["rss_before_mib"],
            phase["rss_peak_mib"],
            phase["rss_after_mib"],
        ])
    h.print_table(
        f"{args.concurrency} parallel uploads per phase, {args.size / 1e6:g} MB each (slow: 1 byte/s), no API key",
        ["phase", "status", "type", "answer s (max)", "MB sent before answer", "MB sent in all", "RSS before", "peak", "after"],
        rows,
    )
    ok = growth <= RSS_GROWTH_TARGET_MIB
    print(f"\nRSS {start_rss:.1f} MiB at start, peak {peak:.1f}, end {end_rss:.1f}: growth {growth:.1f} MiB "
          f"(target ≤ {RSS_GROWTH_TARGET_MIB}): {h.verdict(ok)}")
    print(results["machine_note"])
    results["target_met"] = ok
    h.write_result(h.result_name(args, "uploads"), results)


if __name__ == "__main__":
    main()
