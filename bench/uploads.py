#!/usr/bin/env python
"""Hostile uploads: the gateway's memory and CPU, and how soon each is cut.

    .venv/bin/python bench/uploads.py            # 4 × 400 MB declared, 4 × 400 MB chunked, 4 slow, 8 × 30 MB wrong key (~1 min)
    .venv/bin/python bench/uploads.py --quick    # 4 × 40 MB, read timeout 3 s (seconds)
    .venv/bin/python bench/uploads.py --root DIR # the gateway run from another checkout (before/after)

Four phases against one daphne process (the gateway's default 32 MiB body limit):

- declared: C parallel `POST /v1/messages` with `content-length: SIZE`, the body written at full
  speed right after the headers (not waiting for an answer, as a hostile client does);
- chunked: C parallel uploads with `transfer-encoding: chunked`, 1 MiB chunks, no length;
- slow: C uploads at 1 byte/s (`content-length: 1000`), cut after MESSAGES_BODY_READ_TIMEOUT_S;
- wrong key: 8 parallel uploads of 30 MB (under the limit) with `content-length`, each with a key
  of its own that is no key (a database lookup each), the body written at full speed: the
  anonymous cost of a request, refused from its headers before the body is read;
- with `--under-limit`, a fifth: C bodies of 1 KiB under the limit, sent whole with a valid key,
  which the guard lets through (the consumer answers 400): what a body the gateway accepts costs
  while daphne queues it and the consumer joins it (not part of the target).

The first three carry a valid API key: a request without one is refused at its headers (as the
wrong-key phase shows), so only a keyed client's body reaches the limits they measure. Every
client reads the answer while it is still writing. Reported per phase: the statuses, the seconds
from connecting to the answer, the bytes written before the gateway's answer and before the
connection ended; for the gateway: RSS before the phase, its peak during the phase (sampled every
20 ms from /proc) and after it, and its CPU seconds over the phase per upload. Targets: RSS growth
≤ 64 MiB over the whole run (issue 9); in the wrong-key phase, RSS growth ≤ 16 MiB and each upload
refused within 50 ms (issue "Hardening").
"""

from __future__ import annotations

import argparse
import json
import secrets
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
WRONG_KEY_RSS_TARGET_MIB = 16
WRONG_KEY_ANSWER_TARGET_S = 0.05
WRONG_KEY_UPLOADS = 8
WRONG_KEY_SIZE = 30_000_000
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
    parser.add_argument("--root", type=Path, help="run the gateway from this checkout instead (a before/after comparison)")
    args = h.parse_args(parser, quick={"size": 40_000_000, "read_timeout": 3.0}, full={"size": 400_000_000, "read_timeout": 30.0})
    return args


def head(length: int | None, key: str) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (
        f"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"anthropic-version: {h.ANTHROPIC_VERSION}\r\nx-api-key: {key}\r\n{framing}\r\n\r\n"
    ).encode()


def wrong_key() -> str:
    return "sk-gw-" + secrets.token_urlsafe(32)  # well-formed, and no key: a database lookup each


def upload(port: int, size: int, mode: str, result: Upload, key: str) -> None:
    """One client: a writer thread sends the body, this thread reads the answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.monotonic()
    answered = threading.Event()

    def write() -> None:
        try:
            if mode == "slow":
                sock.sendall(head(size, key))
                for _ in range(size):
                    if answered.wait(1.0):  # one byte a second, until the gateway answers
                        return
                    sock.sendall(b"x")
                    result.sent_total += 1
                return
            sock.sendall(head(size if mode == "declared" else None, key))
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


def run_phase(port: int, pid: int, mode: str, size: int, concurrency: int, keys: list[str]) -> dict[str, Any]:
    """`keys`: one per upload (the same valid key, or a wrong one each)."""
    results = [Upload() for _ in range(concurrency)]
    before = h.rss_mib(pid)
    cpu_before = h.proc_cpu_seconds(pid)
    with RssSampler(pid) as sampler:
        threads = [threading.Thread(target=upload, args=(port, size, mode, r, k)) for r, k in zip(results, keys, strict=True)]
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
        "cpu_s_per_upload": (h.proc_cpu_seconds(pid) - cpu_before) / concurrency,
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
        key = stack.create_api_key()
        gateway = stack.start_gateway(settings, expect_pools=["bench"], root=args.root)
        results["machine_note"] = h.wait_for_quiet(args.quiet_wait)
        start_rss = h.rss_mib(gateway.pid)
        for mode, size in (("declared", args.size), ("chunked", args.size), ("slow", 1000)):
            results["phases"].append(run_phase(gateway.port, gateway.pid, mode, size, args.concurrency, [key] * args.concurrency))
        wrong = run_phase(gateway.port, gateway.pid, "declared", WRONG_KEY_SIZE, WRONG_KEY_UPLOADS, [wrong_key() for _ in range(WRONG_KEY_UPLOADS)])
        wrong["mode"] = "wrong key"
        results["phases"].append(wrong)
        end_rss = h.rss_mib(gateway.pid)
        peak = max(p["rss_peak_mib"] for p in results["phases"])
        if args.under_limit:
            under = run_phase(gateway.port, gateway.pid, "declared", UNDER_LIMIT, args.concurrency, [key] * args.concurrency)
            under["mode"] = "under-limit"
            results["phases"].append(under)
    growth = peak - start_rss
    wrong_growth = wrong["rss_peak_mib"] - wrong["rss_before_mib"]
    wrong_answer = max(u["answered_at"] or float("inf") for u in wrong["uploads"])
    results.update({
        "rss_start_mib": start_rss, "rss_peak_mib": peak, "rss_end_mib": end_rss, "rss_growth_mib": growth,
        "wrong_key_rss_growth_mib": wrong_growth, "wrong_key_answer_s_max": wrong_answer,
    })

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
            phase["cpu_s_per_upload"] * 1000,
        ])
    h.print_table(
        f"{args.concurrency} parallel uploads per phase, {args.size / 1e6:g} MB each (slow: 1 byte/s), a valid API key; "
        f"wrong key: {WRONG_KEY_UPLOADS} × {WRONG_KEY_SIZE / 1e6:g} MB",
        ["phase", "status", "type", "answer s (max)", "MB sent before answer", "MB sent in all", "RSS before", "peak", "after",
         "CPU ms/upload"],
        rows,
    )
    ok = growth <= RSS_GROWTH_TARGET_MIB
    print(f"\nRSS {start_rss:.1f} MiB at start, peak {peak:.1f}, end {end_rss:.1f}: growth {growth:.1f} MiB "
          f"(target ≤ {RSS_GROWTH_TARGET_MIB}): {h.verdict(ok)}")
    wrong_ok = wrong_growth <= WRONG_KEY_RSS_TARGET_MIB and wrong_answer <= WRONG_KEY_ANSWER_TARGET_S
    print(f"wrong key: RSS growth {wrong_growth:.1f} MiB (target ≤ {WRONG_KEY_RSS_TARGET_MIB}), slowest refusal "
          f"{wrong_answer * 1000:.1f} ms (target ≤ {WRONG_KEY_ANSWER_TARGET_S * 1000:.0f}), "
          f"{wrong['cpu_s_per_upload'] * 1000:.1f} ms of gateway CPU per upload: {h.verdict(wrong_ok)}")
    print(results["machine_note"])
    results["target_met"] = ok and wrong_ok
    h.write_result(h.result_name(args, "uploads"), results)


if __name__ == "__main__":
    main()
