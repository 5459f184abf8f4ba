"""`manage.py serve`: N daphne processes on one port, so a many-core host serves one port without
a load balancer in front.

    manage.py serve --host 0.0.0.0 --port 8000 --processes 8 [--shared-socket] [-- extra daphne options]

One event loop uses one core; this command binds the port before it starts N `daphne --fd`
children: one socket per child with `SO_REUSEPORT`, so the kernel spreads new connections evenly
over them (messages_api/server/listeners.py says why), or with `--shared-socket` one socket all
of them accept from. A connection, and the stream on it, belongs to the process that accepted it,
so that process sees its client leave. Under systemd socket activation (`LISTEN_FDS`), the one
socket systemd passes is shared instead.

Signals: SIGTERM (or SIGINT) is forwarded to every child; each drains (stops accepting, finishes
its requests for up to `GATEWAY_DRAIN_TIMEOUT_S`, see messages_api/server/drain.py) and exits; the
supervisor exits when they have, killing any still running `GATEWAY_DRAIN_TIMEOUT_S + 10` s
later. A child that dies on its own is restarted; more than `MAX_RESTARTS` deaths within
`RESTART_WINDOW_S` stop the whole server with exit status 1 (something is wrong that a restart
will not fix).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from types import FrameType
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from messages_api.server.listeners import bind_listeners, reuse_port_supported

APPLICATION = "disagg_project.asgi:application"
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
POLL_INTERVAL_S = 0.2
# systemd's first passed descriptor (sd_listen_fds(3)).
SD_LISTEN_FDS_START = 3


class Command(BaseCommand):
    help = "Serve the gateway with N daphne processes on one port."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
        parser.add_argument(
            "--processes", type=int, default=os.cpu_count() or 1,
            help="daphne processes to run (default: one per CPU)",
        )
        parser.add_argument("--backlog", type=int, default=2048, help="listen backlog of each socket")
        parser.add_argument(
            "--shared-socket", action="store_true",
            help="one listening socket for every process (whichever wakes first accepts) instead of one "
            "socket each with SO_REUSEPORT (connections spread evenly)",
        )
        parser.add_argument("daphne_args", nargs="*", help="extra daphne options, after `--`")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["processes"] < 1:
            raise CommandError("--processes must be at least 1")
        listeners = self._listening_sockets(options)
        host, port = listeners[0].getsockname()[:2]
        supervisor = Supervisor(listeners, options["processes"], list(options["daphne_args"]), self.stdout.write)
        self.stdout.write(
            f"gateway on http://{_url_host(host)}:{port} with {options['processes']} daphne process(es)"
        )
        self.stdout.flush()
        status = supervisor.run()
        if status:
            raise CommandError(f"stopped: {supervisor.reason}", returncode=status)

    def _listening_sockets(self, options: dict[str, Any]) -> list[socket.socket]:
        if settings.SYSTEMD_LISTEN_FDS >= 1:
            return [socket.socket(fileno=SD_LISTEN_FDS_START)]
        host = options["host"]
        shared = options["shared_socket"] or not reuse_port_supported()
        try:
            return bind_listeners(host, options["port"], 1 if shared else options["processes"], options["backlog"])
        except OSError as exc:
            raise CommandError(f"cannot listen on {host}:{options['port']}: {exc}") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class Supervisor:
    """Starts, restarts and stops the daphne children; child i accepts from listener i (modulo
    their number: one shared socket, or one each). The supervisor keeps every socket open, so a
    restarted child's connections wait in its socket's backlog meanwhile."""

    def __init__(self, listeners: list[socket.socket], processes: int, daphne_args: list[str], log: Any) -> None:
        self.listeners = listeners
        self.processes = processes
        self.daphne_args = daphne_args
        self.log = log
        self.children: list[subprocess.Popen[bytes]] = []
        self.deaths: deque[float] = deque()
        self.stop_signal: int | None = None
        self.reason = ""

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        self.children = [self._spawn(index) for index in range(self.processes)]
        while self.stop_signal is None:
            time.sleep(POLL_INTERVAL_S)
            if self._restart_dead():
                self.stop_signal = signal.SIGTERM
                return self._stop(1)
        return self._stop(0)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self.reason = signal.Signals(signum).name
            return
        # A second signal while stopping: pass it on, so the children stop without draining.
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        fd = self.listeners[index % len(self.listeners)].fileno()
        command = [sys.executable, "-m", "daphne", "--fd", str(fd), *self.daphne_args, APPLICATION]
        # Children do not inherit LISTEN_PID/LISTEN_FDS: they are told the descriptor explicitly.
        env = {k: v for k, v in os.environ.items() if k not in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")}
        return subprocess.Popen(command, pass_fds=(fd,), env=env)

    def _restart_dead(self) -> bool:
        """Replace children that exited on their own; True when they die too often to go on."""
        now = time.monotonic()
        for index, child in enumerate(self.children):
            status = child.poll()
            if status is None:
                continue
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > RESTART_WINDOW_S:
                self.deaths.popleft()
            if len(self.deaths) > MAX_RESTARTS:
                self.reason = f"{len(self.deaths)} daphne processes died within {RESTART_WINDOW_S:.0f} s"
                return True
            self.log(f"daphne process {child.pid} exited with {status}; starting another")
            self.children[index] = self._spawn(index)
        return False

    def _stop(self, status: int) -> int:
        # Close our copies of the sockets first: once every child has stopped listening, new
        # connections are refused instead of queuing where nobody accepts them.
        for listener in self.listeners:
            listener.close()
        forward = self.stop_signal or signal.SIGTERM
        for child in self.children:
            if child.poll() is None:
                child.send_signal(forward)
        deadline = time.monotonic() + float(settings.GATEWAY_DRAIN_TIMEOUT_S) + 10.0
        for child in self.children:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self.log(f"daphne process {child.pid} did not stop in time; killing it")
                child.kill()
                child.wait()
        return status
