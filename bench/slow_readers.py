#!/usr/bin/env python
"""What slow-reading clients cost the gateway's memory: N streams whose clients barely read.

    .venv/bin/python bench/slow_readers.py                      # 100 slow readers, 60,000-token answers (~5 min)
    .venv/bin/python bench/slow_readers.py --b-root /tmp/base   # and the same against another checkout, same run (~10 min)
    .venv/bin/python bench/slow_readers.py --quick              # 10 readers, 10 s

A real gateway (one daphne process, SQLite, a sim worker pair unpaced: each answer is written as
fast as it is read) and one API key. N clients each open a connection with a 4 KiB receive buffer
(SO_RCVBUF set before connecting), send a streamed `POST /v1/messages` for a 60,000-token answer
(`[sim tokens=60000]`) and then read 1 byte a second each (issue 42's probe). For --hold-s the
gateway's RSS is sampled every second, with the bytes in its connections' kernel send queues
(`/proc/net/tcp`, its port) and the generation worker's RSS (where an answer waits once the gateway
stops reading it). Then the clients hang up and the RSS left is read once it settles.

Before the clients: a warm-up (20 ordinary streams read whole), then the baseline RSS. Growth is
the peak during the hold less the baseline.

The hold is long enough for a gateway that does not pace its streams to read every answer whole
(the sim worker, on this 2-core machine, makes ~25,000 tokens a second across 100 streams), and
longer than MESSAGES_CLIENT_STALL_S (60 s): a client reading 1 byte a second into a 4 KiB buffer
never reopens its TCP window, takes nothing in that time, and is cut ("cut": the audit rows
`failed timeout_error`; every row's outcome is in the JSON); the peak comes before. `--b-env MESSAGES_CLIENT_STALL_S=0` measures the bound alone.

Target (issue 42): 100 slow readers, gateway RSS growth <= 64 MiB.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import harness as h

POOL = "bench-pool"
TARGET_MIB = 64.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, help="slow-reading clients (default 100; --quick 10)")
    parser.add_argument("--tokens", type=int, default=60000, help="tokens per answer (default 60000)")
    parser.add_argument("--hold-s", type=float, help="seconds the clients are held, slow-reading (default 240; --quick 10)")
    parser.add_argument("--rcvbuf", type=int, default=4096, help="the clients' SO_RCVBUF (default 4096)")
    parser.add_argument("--b-root", type=Path, help="also run a gateway from this checkout (same database and workers), after this one's")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE", help="settings for the b gateway only")
    return h.parse_args(parser, quick={"clients": 10, "hold_s": 10.0}, full={"clients": 100, "hold_s": 240.0})


def send_queue_bytes(port: int) -> int:
    """Bytes in the kernel send queues of the connections on local `port` (the gateway's side)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                total += int(fields[4].split(":")[0], 16)
    return total


class SlowReaders:
    """N connections, each reading one byte a second once its request is sent."""

    def __init__(self, port: int, key: str, count: int, tokens: int, rcvbuf: int) -> None:
        body = h.messages_body(f"[sim tokens={tokens}]", stream=True, max_tokens=tokens)
        request = h.gateway_request(port, key, body)
        self.socks: list[socket.socket] = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.connect(("127.0.0.1", port))
            sock.sendall(request)
            sock.setblocking(False)
            self.socks.append(sock)
        self.read = [0] * count
        self.closed = [False] * count  # reset or ended by the gateway
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for i, sock in enumerate(self.socks):
                if self.closed[i]:
                    continue
                try:
                    data = sock.recv(1)
                except BlockingIOError:
                    continue
                except OSError:
                    self.closed[i] = True
                    continue
                if not data:
                    self.closed[i] = True
                self.read[i] += len(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
            except OSError:
                pass
            sock.close()


def warm_up(port: int, key: str) -> None:
    body = h.messages_body("[sim tokens=200]", stream=True, max_tokens=200)
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(h.gateway_request(port, key, body))
            data = b""
            while b"message_stop" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data = data[-64:] + chunk


def settle(pid: int, timeout: float = 20.0) -> float:
    """The RSS once it has stopped falling for 2 s (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    last, since = h.rss_mib(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = h.rss_mib(pid)
        if now < last - 0.5:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 2.0:
            break
    return h.rss_mib(pid)


def row_outcomes(stack: h.Stack, since: str) -> dict[str, int]:
    """The audit rows of requests received since `since` (UTC), by status and error type: how the
    slow readers' requests ended (a stalled client's: `failed timeout_error`)."""
    with sqlite3.connect(stack.tmp / "gateway.sqlite3") as db:
        rows = db.execute(
            "SELECT status, error_type, count(*) FROM messages_api_messagerequest WHERE received_at >= ? GROUP BY 1, 2", (since,)
        ).fetchall()
    return {f"{status} {error}".strip(): count for status, error, count in rows}


def measure(stack: h.Stack, gateway: h.GatewayProc, worker_pid: int, key: str, args: argparse.Namespace) -> dict[str, Any]:
    pid = gateway.process.pid
    warm_up(gateway.port, key)
    h.wait_for_quiet(args.quiet_wait)
    baseline = settle(pid)
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    worker_baseline = h.rss_mib(worker_pid)
    readers = SlowReaders(gateway.port, key, args.clients, args.tokens, args.rcvbuf)
    samples: list[dict[str, float]] = []
    start = time.monotonic()
    try:
        while time.monotonic() - start < args.hold_s:
            time.sleep(1.0)
            samples.append({
                "t": round(time.monotonic() - start, 1), "rss_mib": round(h.rss_mib(pid), 1),
                "send_queues_mib": round(send_queue_bytes(gateway.port) / 2**20, 1),
                "worker_rss_mib": round(h.rss_mib(worker_pid), 1),
            })  # fmt: skip
        cut = sum(readers.closed)
        read = sum(readers.read)
    finally:
        readers.close()
    after = settle(pid)
    time.sleep(2.0)  # the background writer's last batch of rows
    outcomes = row_outcomes(stack, since)
    peak = max(s["rss_mib"] for s in samples)
    return {
        "baseline_rss_mib": round(baseline, 1), "peak_rss_mib": peak, "growth_mib": round(peak - baseline, 1),
        "end_rss_mib": samples[-1]["rss_mib"], "end_growth_mib": round(samples[-1]["rss_mib"] - baseline, 1),
        "peak_send_queues_mib": max(s["send_queues_mib"] for s in samples),
        "worker_rss_growth_mib": round(max(s["worker_rss_mib"] for s in samples) - worker_baseline, 1),
        "after_hang_up_rss_mib": round(after, 1), "clients_seen_closed": cut, "rows": outcomes, "bytes_read_by_clients": read, "samples": samples,
    }  # fmt: skip


def main() -> None:
    args = parse_args()
    with h.Stack("slow_readers", keep=args.keep) as stack:
        stack.migrate()
        ctx, gen = h.start_sim_pair(stack, tokens_per_second=0, prefill_tokens_per_second=0)
        for role, sim in (("context", ctx), ("generation", gen)):
            stack.register_worker(POOL, h.MODEL, role, sim.url, schedule_style="context_first")
        key = stack.create_api_key("bench-slow-readers")
        b_env = dict(item.split("=", 1) for item in args.b_env)
        results: dict[str, Any] = {"clients": args.clients, "tokens": args.tokens, "hold_s": args.hold_s, "rcvbuf": args.rcvbuf}
        runs: list[tuple[str, Path | None, dict[str, str]]] = [("this checkout", None, {})]
        if args.b_root or b_env:
            runs.append((f"b: {args.b_root or 'this checkout'} {' '.join(args.b_env)}".strip(), args.b_root, b_env))
        rows = []
        for label, root, env in runs:
            gateway = stack.start_gateway(env, expect_pools=[POOL], root=root)
            result = results[label] = measure(stack, gateway, gen.process.pid, key, args)
            gateway.stop()
            rows.append([label, result["baseline_rss_mib"], result["peak_rss_mib"], result["growth_mib"], result["end_growth_mib"],
                         result["peak_send_queues_mib"], result["worker_rss_growth_mib"], result["after_hang_up_rss_mib"],
                         result["rows"].get("failed timeout_error", 0)])  # fmt: skip
        h.print_table(
            f"{args.clients} clients reading 1 byte/s (SO_RCVBUF {args.rcvbuf}) on {args.tokens:,}-token answers, held {args.hold_s:g} s (MiB)",
            ["gateway", "RSS before", "peak", "growth", "growth at end", "send queues", "worker RSS growth", "after hang-up", "cut (rows)"],
            rows,
        )
        growth = results["this checkout"]["growth_mib"]
        print(f"this checkout: RSS growth {growth:.1f} MiB with {args.clients} slow readers (target <= {TARGET_MIB:g} for 100): "
              f"{h.verdict(growth <= TARGET_MIB)}")  # fmt: skip
        h.write_result(h.result_name(args, "slow_readers"), results)


if __name__ == "__main__":
    main()
