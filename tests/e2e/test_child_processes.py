"""How the tests start processes they do not write: the ports handed to those that bind their own,
the real-vLLM start-up's retry when one was taken anyway (CI lost a 7-minute vLLM start to that
once), and the CPUs the engine is confined to."""

from __future__ import annotations

import os
import random
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import ports
from tests.support.realvllm import server as realvllm_server
from tests.support.realvllm.server import CPUS_ENV, PortTaken, RealVllm, engine_cpus, start_on_fresh_ports


def test_unused_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    handed = [ports.unused_port() for _ in range(50)]
    assert len(set(handed)) == len(handed)
    assert all(ports.LOWEST <= port < ephemeral_start for port in handed)
    for port in handed[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_holds_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        choices = iter([taken, taken, free])
        monkeypatch.setattr(ports, "LOWEST", 1024)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
        monkeypatch.setattr(random, "randint", lambda low, high: next(choices))
        assert ports.unused_port() == free


def test_a_refused_url_refuses() -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(ports.refused_url(), timeout=5)


class ScriptedEngine(RealVllm):
    """A RealVllm whose process is a short script: it says its port is taken (the way vLLM's NIXL
    handshake listener dies, leaving the server up and unhealthy) or serves /health. Its server
    is a `python -c` script of its own, not tests/support/scripted.py's: what is tested is how a
    RealVllm starts and stops its process."""

    def __init__(self, port_taken: bool, log_dir: Path) -> None:
        super().__init__(name="scripted")
        self.log_path = log_dir / self.log_path.name
        self.port_taken = port_taken

    def command(self) -> list[str]:
        if self.port_taken:
            script = (
                "import time; print('zmq.error.ZMQError: Address already in use', flush=True);"
                " time.sleep(600)"
            )
        else:
            script = (
                "import http.server as h\n"
                "class H(h.BaseHTTPRequestHandler):\n"
                "    def do_GET(self): self.send_response(200); self.end_headers()\n"
                f"h.HTTPServer(('127.0.0.1', {self.port}), H).serve_forever()\n"
            )
        return [sys.executable, "-c", script]


def test_a_start_that_finds_a_port_taken_stops_at_once_and_starts_again_on_fresh_ports(tmp_path: Path) -> None:
    built: list[ScriptedEngine] = []

    def build() -> list[RealVllm]:
        # The first start's second server finds its port taken; the second start succeeds.
        pair = [ScriptedEngine(False, tmp_path), ScriptedEngine(not built, tmp_path)]
        built.extend(pair)
        return list(pair)

    started = time.monotonic()
    servers = start_on_fresh_ports(build)
    try:
        assert time.monotonic() - started < 30  # not the 420 s /health deadline
        assert len(built) == 4 and servers == built[2:]
        assert len({server.port for server in built}) == 4
        assert all(server.process is not None and server.process.poll() is not None for server in built[:2])
        assert all(httpx.get(server.url + "/health", timeout=5).status_code == 200 for server in servers)
    finally:
        for server in built:
            server.stop(grace=5)


def test_a_port_taken_on_every_attempt_is_reported(tmp_path: Path) -> None:
    built: list[ScriptedEngine] = []

    def build() -> list[RealVllm]:
        built.append(ScriptedEngine(True, tmp_path))
        return [built[-1]]

    try:
        with pytest.raises(PortTaken, match="Address already in use"):
            start_on_fresh_ports(build, attempts=2)
        assert len(built) == 2
        assert all(server.process is not None and server.process.poll() is not None for server in built)
    finally:
        for server in built:
            server.stop(grace=5)


def test_the_needle_is_found_when_the_log_writes_it_in_two_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(realvllm_server, "LOG_DIR", tmp_path)
    server = RealVllm(name="pieces")
    server.log_path = tmp_path / "pieces.log"
    server.log_path.write_bytes(b"zmq.error.ZMQError: Address already")
    assert not server._log_says_port_taken()
    with server.log_path.open("ab") as log:
        log.write(b" in use (addr='tcp://127.0.0.1:41259')\n")
    assert server._log_says_port_taken()


def test_the_engine_gets_the_upper_half_of_the_cpus_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv(CPUS_ENV, raising=False)
    assert engine_cpus() == {1}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert engine_cpus() == {2, 3, 4}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert engine_cpus() == {3}  # one CPU: shared, there is no other
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv(CPUS_ENV, "all")
    assert engine_cpus() == {0, 1, 2, 3}
    monkeypatch.setenv(CPUS_ENV, "0,2")
    assert engine_cpus() == {0, 2}
    monkeypatch.setenv(CPUS_ENV, "7")  # none of them allowed here: all allowed ones
    assert engine_cpus() == {0, 1, 2, 3}


def test_a_launched_engine_runs_on_its_cpus(tmp_path: Path) -> None:
    server = ScriptedEngine(False, tmp_path)
    server.launch()
    try:
        assert server.process is not None
        assert os.sched_getaffinity(server.process.pid) == engine_cpus()
    finally:
        server.stop(grace=5)
