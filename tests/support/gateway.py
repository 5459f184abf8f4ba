"""Test support: the gateway as a real daphne process on the test database.

The listening socket is bound here and handed to daphne (`--fd`), so the port is known before the
process starts and no other process can take it in between.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from django.db import connection

from workers.sim.process import stop_process

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Short intervals keep the suite fast; a test that needs others starts its own gateway.
DEFAULT_ENV = {
    "MESSAGES_STREAM_START_WAIT_S": "0.3",
    "MESSAGES_PING_INTERVAL_S": "0.5",
    "REGISTRY_REFRESH_INTERVAL_S": "0.1",
    "AUDIT_FLUSH_INTERVAL_S": "0.01",
    "WORKER_HANDOFF_RELEASE_TIMEOUT_S": "3",
    # SIGTERM stops at once unless a test asks for a drain (tests/e2e/test_serve.py).
    "GATEWAY_DRAIN_TIMEOUT_S": "0",
    # Every gateway probes every endpoint in the (shared) test database: probing is off unless a
    # test starts a gateway of its own for it.
    "HEALTH_CHECK_INTERVAL_S": "3600",
    # Likewise the engines' load (their /metrics): read only by a test's own gateway for it
    # (tests/e2e/test_engine_load.py).
    "ENGINE_LOAD_POLL_S": "0",
    # Every test's client is 127.0.0.1, and many send wrong keys on purpose: no failure throttle per
    # address unless a test starts a gateway of its own for it (tests/e2e/test_key_flood.py).
    "GATEWAY_AUTH_FAILURES_PER_MINUTE": "0",
    # Every gateway shares the test database: only a test of Message Batches runs a batch runner
    # (tests/e2e/test_batches*.py), so that no other gateway claims its items.
    "BATCH_RUNNER_ENABLED": "0",
    # This run's own keys in a shared Redis (only gateways started with REDIS_URL use it).
    "REDIS_KEY_PREFIX": f"test-{os.getpid()}-{secrets.token_hex(4)}:",
}
# What the tests time the test gateways' streams against, in seconds.
START_WAIT = float(DEFAULT_ENV["MESSAGES_STREAM_START_WAIT_S"])
PING_INTERVAL = float(DEFAULT_ENV["MESSAGES_PING_INTERVAL_S"])


def test_database_url() -> str:
    """The URL of the database the test run uses (created by pytest-django)."""
    settings = connection.settings_dict
    if settings["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{Path(settings['NAME']).resolve()}"
    user = settings.get("USER") or ""
    password = f":{settings['PASSWORD']}" if settings.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    return f"postgres://{auth}{settings.get('HOST') or '127.0.0.1'}:{settings.get('PORT') or 5432}/{settings['NAME']}"


def gateway_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a gateway process under test: test settings, the test database, short
    intervals, then `env`."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "disagg_project.test_settings",
        "DATABASE_URL": test_database_url(),
        **DEFAULT_ENV,
        **(env or {}),
    }


class Gateway:
    """`host`: the address the socket is bound to ("0.0.0.0" for every interface; the URL stays
    loopback's); `daphne_args`: more options on daphne's command line (`--proxy-headers`);
    `application`: the ASGI application daphne serves (it must answer `HEAD /` with a 200);
    `sock`: a listening socket made elsewhere instead (in a network namespace: tests/support/netns.py),
    `command_prefix`: what runs daphne (`ip netns exec NAME`)."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        *,
        host: str = "127.0.0.1",
        daphne_args: Sequence[str] = (),
        application: str = "disagg_project.asgi:application",
        sock: socket.socket | None = None,
        command_prefix: Sequence[str] = (),
    ) -> None:
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sock.listen(1024)
        self.sock = sock
        host, self.port = sock.getsockname()[:2]
        self.url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"
        self.env = gateway_env(env)
        self.daphne_args = list(daphne_args)
        self.application = application
        self.command_prefix = list(command_prefix)
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = PROJECT_ROOT / ".gateway" / f"test-daphne-{os.getpid()}-{self.port}.log"

    def start(self) -> Gateway:
        self.log_path.parent.mkdir(exist_ok=True)
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [
                *self.command_prefix,
                sys.executable, "-m", "daphne",
                "--fd", str(self.sock.fileno()),
                "--application-close-timeout", "5",
                *self.daphne_args,
                self.application,
            ],
            cwd=PROJECT_ROOT,
            env=self.env,
            pass_fds=[self.sock.fileno()],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.head(self.url + "/", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"gateway did not become ready:\n{self.log()}")

    def log(self, limit: int | None = 5000) -> str:
        """The last `limit` characters of the process's log (None: all of it)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text if limit is None else text[-limit:]

    def dump_stacks(self) -> None:
        """Ask the process to write its thread and task stacks to its log (`kill -USR1`,
        messages_api/server/state_dump.py)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGUSR1)

    def kill(self, sig: int = 9) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        self.sock.close()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
