"""Starting simulated workers as real processes (used by `make run`, the tests and benchmarks).

Each worker is `manage.py simworker` in its own process::

    worker = start_simworker("context", kv_timeout=5)        # a free port
    worker.wait_for(lambda s: s["completed"] == 1)
    worker.stop()

Options are the command's flags with underscores: `tokens_per_second=0` becomes
`--tokens-per-second 0`. Workers still running when the interpreter exits are stopped.
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
# A sim prints its listening line within a second or two; on a saturated 2-core CI machine one
# took over 20 s (2026-12-06: the whole test_simworker module then errored). Only a sim that never
# starts waits this long.
STARTUP_TIMEOUT_S = 60.0
_LISTENING = " listening on "

_running: set[SimWorker] = set()


@dataclass(eq=False)
class SimWorker:
    """A running simulated worker process."""

    role: str
    host: str
    port: int
    process: subprocess.Popen[str] = field(repr=False)
    _reader: threading.Thread | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _get(self, path: str) -> Any:
        response = httpx.get(self.url + path, timeout=5.0, trust_env=False)
        response.raise_for_status()
        return response.json()

    def stats(self) -> dict[str, Any]:
        """The worker's /sim/stats."""
        result: dict[str, Any] = self._get("/sim/stats")
        return result

    def requests(self) -> list[dict[str, Any]]:
        """The last 200 chat request bodies the worker received, newest last."""
        result: list[dict[str, Any]] = self._get("/sim/requests")
        return result

    def reset(self) -> None:
        """Zeroes the counters and the request log (held KV handoffs stay)."""
        httpx.post(self.url + "/sim/reset", timeout=5.0, trust_env=False).raise_for_status()

    def kv_events(self, **body: Any) -> dict[str, Any]:
        """Change its KV-event publisher (`POST /sim/kv_events`: `mode=`, `reset_prefix_cache=`, `restart=`)."""
        response = httpx.post(self.url + "/sim/kv_events", json=body, timeout=5.0, trust_env=False)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def outside_load(self, waiting: int = 0, running: int = 0, **more: Any) -> None:
        """Make its metrics report this much load beyond its own (`POST /sim/outside_load`;
        `kv_usage=`, `metrics_status=` too)."""
        httpx.post(
            self.url + "/sim/outside_load", json={"waiting": waiting, "running": running, **more}, timeout=5.0, trust_env=False
        ).raise_for_status()

    def health_delay(self, seconds: float) -> None:
        """Make its /health answer `seconds` late from now on (`POST /sim/health`; 0: at once),
        chat requests served as before."""
        httpx.post(self.url + "/sim/health", json={"delay_s": seconds}, timeout=5.0, trust_env=False).raise_for_status()

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0
    ) -> dict[str, Any]:
        """Polls stats until `predicate(stats)` holds; returns them, or raises AssertionError."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"{self.role} worker at {self.url}: condition not met within {timeout}s; "
                    f"last stats: {stats}"
                )
            time.sleep(0.02)

    def stop(self) -> None:
        """Terminates the process, killing it if it has not exited within 5 s."""
        _running.discard(self)
        stop_process(self.process, grace=5.0)
        if self._reader is not None:
            self._reader.join(timeout=2.0)  # it closes stdout once it reads EOF

    def __enter__(self) -> SimWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _command(role: str, host: str, port: int, options: dict[str, Any]) -> list[str]:
    args = [sys.executable, "manage.py", "simworker", "--role", role, "--host", host, "--port", str(port)]
    for name, value in options.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def stop_process(process: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within `grace` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, however it dies (Linux only)."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # elsewhere the atexit hook below is the only guard


def _read_lines(stream: Any, lines: queue.Queue[str | None]) -> None:
    # Keeps draining stdout after the listening line so the worker never blocks on a full pipe.
    with stream:
        for line in stream:
            lines.put(line)
    lines.put(None)


def start_simworker(
    role: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    env: dict[str, str] | None = None,
    **options: Any,
) -> SimWorker:
    """Starts `manage.py simworker --role ROLE` (port 0: a free one) and waits until it listens."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        _command(role, host, port, options),
        # The kernel ties PDEATHSIG to the forking thread, not the process: only from the main
        # thread does it mean "when the parent process dies".
        preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True)
    reader.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    seen: list[str] = []
    while True:
        remaining = deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(remaining, 0.0)) if remaining > 0 else None
        except queue.Empty:
            line = None
        if line is not None and _LISTENING in line:
            port = int(line.strip().rsplit(":", 1)[1])
            worker = SimWorker(role=role, host=host, port=port, process=process, _reader=reader)
            _running.add(worker)
            return worker
        if line is not None:
            seen.append(line)
            continue
        process.kill()
        process.wait()
        raise RuntimeError(
            f"simworker {role} did not start (exit code {process.returncode}); "
            f"stdout: {''.join(seen)!r}"
        )


@atexit.register
def _stop_all() -> None:
    for worker in list(_running):
        worker.stop()
