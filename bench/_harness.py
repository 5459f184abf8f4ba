"""Shared pieces of the benchmark scripts: processes, /proc sampling, a lean raw HTTP client,
distributions and tables.

Everything here is plain Python (no pytest): each script creates its own SQLite database in a
temporary directory, runs `manage.py migrate`, starts simulated workers (`manage.py simworker`),
registers them, creates an API key and starts daphne on a socket it bound itself (`--fd`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import http.client
import json
import math
import os
import platform
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from tests.support.chunked import ChunkedDecoder  # noqa: E402  (needs the project on the path)
from tests.support.ports import unused_port  # noqa: E402
from workers.sim.process import stop_process  # noqa: E402

RESULTS_DIR = PROJECT_ROOT / "bench" / "results"
_VENV_PYTHON = PROJECT_ROOT / ".venv" / "bin" / "python"
PYTHON = str(_VENV_PYTHON) if _VENV_PYTHON.exists() else sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL = "sim-model"
ANTHROPIC_VERSION = "2023-06-01"
LISTEN_BACKLOG = 4096


# --- limits ----------------------------------------------------------------------------------------


def raise_nofile(want: int = 65536) -> int:
    """Raise this process's open-files soft limit (children inherit it); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _child_setup() -> None:
    # Runs in each child before exec: as many open files as the hard limit allows.
    raise_nofile()


# --- /proc -----------------------------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy (not idle or iowait), from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    return (sum(fields[:8]) - idle) / CLK_TCK


def wait_for_quiet(max_wait: float, busy_below: float = 0.15, hold: float = 3.0) -> str:
    """Wait (up to `max_wait` s) until the whole machine has been under `busy_below` of its cores
    for `hold` seconds: other sessions' test suites share these 2 cores. Returns a note."""
    if max_wait <= 0:
        return "did not wait for a quiet machine"
    cores = os.cpu_count() or 1
    start = time.monotonic()
    quiet_since: float | None = None
    last = machine_busy_seconds()
    while time.monotonic() - start < max_wait:
        time.sleep(0.5)
        now = machine_busy_seconds()
        busy = (now - last) / (0.5 * cores)
        last = now
        if busy < busy_below:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= hold:
                return f"machine quiet after {time.monotonic() - start:.0f} s"
        else:
            quiet_since = None
    note = f"machine still busy after waiting {max_wait:.0f} s (other processes): figures are pessimistic"
    print(f"warning: {note}", file=sys.stderr)
    return note


def proc_sys_cpu_seconds(pid: int) -> float:
    """The system (kernel) part of `proc_cpu_seconds`: system calls, and on loopback the
    receiving side's TCP processing that a send runs."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[12]) / CLK_TCK


def proc_minor_faults(pid: int) -> int:
    """Minor page faults of a process (all its threads) so far: on this VM ~3.5 µs each, and a
    glibc heap trim per request shows as dozens of them."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[7])


def thread_cpu_seconds(pid: int, tid: int | None = None) -> float:
    """CPU seconds of one thread (the main thread, where the event loop runs, by default)."""
    tid = pid if tid is None else tid
    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in KiB from /proc/<pid>/status."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith((b"VmRSS:", b"VmHWM:")):
                key, value = line.split(b":", 1)
                out[key.decode()] = int(value.split()[0])
    return out


def rss_mib(pid: int) -> float:
    return proc_memory_kib(pid).get("VmRSS", 0) / 1024


def hwm_mib(pid: int) -> float:
    return proc_memory_kib(pid).get("VmHWM", 0) / 1024


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU seconds used by some processes (and this one) between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.begin: dict[str, float] = {}
        self.used: dict[str, float] = {}
        self.wall = 0.0

    def _read(self) -> dict[str, float]:
        out = {name: proc_cpu_seconds(pid) for name, pid in self.pids.items()}
        out["machine"] = machine_busy_seconds()
        for name, pid in self.pids.items():
            if name.startswith("gateway"):
                # The event loop's own thread; the rest is the audit writer and executor threads.
                out[f"{name}:loop-thread"] = thread_cpu_seconds(pid)
            if name.startswith(("gateway", "router", "floor")):
                out[f"{name}:kernel"] = proc_sys_cpu_seconds(pid)
        out["loadgen"] = self_cpu_seconds()
        return out

    def start(self) -> CpuMeter:
        self.begin = self._read()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> dict[str, float]:
        self.wall = time.perf_counter() - self._t0
        now = self._read()
        self.used = {name: now[name] - self.begin[name] for name in now}
        ours = sum(v for k, v in self.used.items() if k != "machine" and ":" not in k)
        # CPU used by processes outside this benchmark (other sessions' tests, ...): a busy
        # machine makes every latency and throughput figure worse.
        self.used["others"] = max(self.used["machine"] - ours, 0.0)
        return self.used

    def machine_note(self) -> str:
        cores = os.cpu_count() or 1
        busy = self.used.get("machine", 0.0) / (self.wall * cores) * 100 if self.wall else 0.0
        others = self.used.get("others", 0.0) / self.wall if self.wall else 0.0
        return (f"machine: {busy:.0f}% of {cores} cores busy; processes outside this benchmark used "
                f"{others:.2f} cores on average")


# --- processes -------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.process)


@dataclass
class SimProc(Proc):
    role: str = ""
    url: str = ""


@dataclass
class GatewayProc(Proc):
    sock: socket.socket | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        super().stop()
        if self.sock is not None:
            self.sock.close()
            self.sock = None


@dataclass
class RouterProc(Proc):
    port: int = 0


# How each router is started; the arguments after these are the same for both.
ROUTERS: dict[str, list[str]] = {
    "vllm-router": [str(Path(PYTHON).parent / "vllm-router")],
    "sglang-router": [PYTHON, "-m", "sglang_router.launch_router"],
}


FLOORS = ("pipe", "reframe", "pipe-uvloop", "reframe-uvloop")


class Stack:
    """One benchmark's world: a temp dir, a database, sim workers, gateways. A context manager."""

    def __init__(
        self, name: str, *, database_url: str | None = None, keep: bool = False, gateway_nodelay: bool = False
    ) -> None:
        raise_nofile()
        self.name = name
        self.gateway_nodelay = gateway_nodelay
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        self.database_url = database_url or f"sqlite:///{self.tmp / 'gateway.sqlite3'}"
        self.keep = keep
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "disagg_project.settings",
            "DATABASE_URL": self.database_url,
            "SECRET_KEY": "bench-" + secrets.token_urlsafe(32),
            # As deployed, whatever the caller's shell says: DEBUG makes Django record every
            # query the audit writer and the registry run (--b-env DEBUG=1 measures that).
            "DEBUG": "0",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        # The gateway's own knobs come from each gateway's env; none leak in from the caller.
        for key in list(self.env):
            if key.startswith(("MESSAGES_", "WORKER_", "REGISTRY_", "AUDIT_")):
                del self.env[key]
        self.procs: list[Proc] = []
        _stacks.append(self)

    # -- manage.py --

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [PYTHON, "manage.py", *args],
            cwd=PROJECT_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            preexec_fn=_child_setup,
        )
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return result.stdout

    def migrate(self) -> None:
        self.manage("migrate", "--noinput", "-v", "0")

    def register_worker(self, pool: str, model: str, role: str, url: str, **options: Any) -> None:
        args = ["register_worker", "--pool", pool, "--model", model, "--role", role, "--url", url]
        for key, value in options.items():
            if value is not None:
                args += [f"--{key.replace('_', '-')}", str(value)]
        self.manage(*args)

    def pool_settings(self) -> dict[str, dict[str, Any]]:
        """Pools as stored: {name: {model, schedule_style, max_local_prefill_tokens, endpoints}}."""
        code = (
            "import json; from workers.models import WorkerPool as P; print(json.dumps({p.name: {"
            "'model': p.model, 'schedule_style': p.schedule_style, "
            "'max_local_prefill_tokens': p.max_local_prefill_tokens, "
            "'endpoints': p.endpoints.count()} for p in P.objects.all()}))"
        )
        return json.loads(self.manage("shell", "-c", code).strip().splitlines()[-1])

    def create_api_key(self, name: str = "bench") -> str:
        return self.manage("create_api_key", name).strip().splitlines()[-1].strip()

    # -- sim workers --

    def start_simworker(self, role: str, **options: Any) -> SimProc:
        """`manage.py simworker --role ROLE --port 0 ...`; waits for its listening line."""
        log_path = self.tmp / f"sim-{role}-{len(self.procs)}.log"
        args = [PYTHON, "manage.py", "simworker", "--role", role, "--host", "127.0.0.1", "--port", "0"]
        for key, value in options.items():
            if value is not None:
                args += [f"--{key.replace('_', '-')}", str(value)]
        log = open(log_path, "wb")
        process = subprocess.Popen(
            args, cwd=PROJECT_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child_setup
        )
        log.close()
        proc = SimProc(name=f"sim-{role}", process=process, log_path=log_path, role=role)
        self.procs.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = proc.log_tail(100000)
            for line in text.splitlines():
                if " listening on " in line:
                    proc.url = line.strip().rsplit(" ", 1)[1]
                    return proc
            if process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"simworker {role} did not start:\n{proc.log_tail()}")

    # -- gateways --

    def start_gateway(
        self,
        settings: dict[str, Any] | None = None,
        *,
        expect_pools: Iterable[str] = (),
        nodelay: bool | None = None,
        root: Path | None = None,
    ) -> GatewayProc:
        """daphne on a socket bound here and passed with `--fd`; waits until /ready lists the pools.

        `root`: run the gateway from another checkout of the project (an A/B comparison with
        another commit, on the same database and workers).

        daphne (Twisted) leaves Nagle's algorithm on for the connections it accepts; `nodelay`
        (default: the Stack's `gateway_nodelay`) sets TCP_NODELAY on the listening socket, which
        Linux copies to every accepted connection.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.gateway_nodelay if nodelay is None else nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(LISTEN_BACKLOG)
        port = sock.getsockname()[1]
        env = dict(self.env)
        for key, value in (settings or {}).items():
            env[key] = str(value)
        log_path = self.tmp / f"daphne-{port}.log"
        log = open(log_path, "wb")
        process = subprocess.Popen(
            [PYTHON, "-m", "daphne", "--fd", str(sock.fileno()), "disagg_project.asgi:application"],
            cwd=root or PROJECT_ROOT,
            env=env,
            pass_fds=[sock.fileno()],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_child_setup,
        )
        log.close()
        gateway = GatewayProc(name=f"daphne-{port}", process=process, log_path=log_path, sock=sock, port=port)
        self.procs.append(gateway)
        wait_ready(gateway, set(expect_pools))
        return gateway

    # -- the Rust routers (PyPI vllm-router, sglang-router), for side-by-side figures --

    def start_router(self, kind: str, worker_url: str) -> RouterProc:
        """vllm-router or sglang-router in its regular (not prefill/decode) mode in front of one
        worker: the counterpart of the gateway's aggregated path, one request to one worker.
        Started as tests/e2e/test_vllm_router.py and tests/e2e/test_sglang_protocol.py start them: no
        tokenizer policy, proxies pointing at a closed port, Hugging Face clients offline.
        Waits until /health answers 200."""
        if kind not in ROUTERS:
            raise ValueError(f"unknown router {kind!r}; one of {sorted(ROUTERS)}")
        port, metrics_port = unused_port(), unused_port()  # the routers bind them
        command = [*ROUTERS[kind], "--worker-urls", worker_url, "--policy", "round_robin",
                   "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                   "--worker-startup-check-interval", "1"]
        if not shutil.which(command[0]):
            raise RuntimeError(f"{kind} is not installed (requirements.txt pins it)")
        env = {k: v for k, v in self.env.items() if "proxy" not in k.lower()}
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = "http://127.0.0.1:9"
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
        log_path = self.tmp / f"{kind}-{port}.log"
        log = open(log_path, "wb")
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=_child_setup)
        log.close()
        router = RouterProc(name=kind, process=process, log_path=log_path, port=port)
        self.procs.append(router)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                if http_get_json(port, "/health", timeout=1.0)[0] == 200:
                    return router
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{kind} did not become healthy:\n{router.log_tail()}")

    # -- the floor proxies (bench/floor_proxy.py): the least CPU any Python relay can spend --

    def start_floor(self, variant: str, worker_url: str) -> RouterProc:
        """bench/floor_proxy.py in front of one worker; `variant` is one of FLOORS
        (pipe, reframe, pipe-uvloop, reframe-uvloop). Waits for its listening line."""
        if variant not in FLOORS:
            raise ValueError(f"unknown floor {variant!r}; one of {FLOORS}")
        mode, _, loop = variant.partition("-")
        command = [PYTHON, str(PROJECT_ROOT / "bench" / "floor_proxy.py"), "--mode", mode, "--upstream", worker_url]
        if loop == "uvloop":
            command.append("--uvloop")
        log_path = self.tmp / f"floor-{variant}.log"
        log = open(log_path, "wb")
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=_child_setup)
        log.close()
        floor = RouterProc(name=f"floor {variant}", process=process, log_path=log_path)
        self.procs.append(floor)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in floor.log_tail(10000).splitlines():
                if " listening on " in line:
                    floor.port = port_of(line.strip().rsplit(" ", 1)[1])
                    return floor
            if process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"floor proxy {variant} did not start:\n{floor.log_tail()}")

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        if not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is not None:
                self.keep = True
                for proc in self.procs:
                    tail = proc.log_tail(2000)
                    if tail.strip():
                        print(f"--- {proc.name} log ({proc.log_path}) ---\n{tail}", file=sys.stderr)
                print(f"(logs kept in {self.tmp})", file=sys.stderr)
        except Exception:  # e.g. a closed stderr pipe: the processes must be stopped regardless
            pass
        finally:
            self.close()


_stacks: list[Stack] = []


@atexit.register
def _stop_everything() -> None:
    # Whatever way the script ends (an exception, a closed pipe), no child outlives it.
    for stack in _stacks:
        try:
            stack.close()
        except Exception:
            pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _on_sigterm)


def http_get_json(port: int, path: str, timeout: float = 5.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, None
    finally:
        conn.close()


def wait_ready(gateway: GatewayProc, pools: set[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            raise RuntimeError(f"gateway exited with {gateway.process.returncode}:\n{gateway.log_tail()}")
        try:
            status, body = http_get_json(gateway.port, "/ready", timeout=2.0)
            last = (status, body)
            listed = (body or {}).get("pools", {})
            # Other pools in a shared database may be unroutable (/ready is then 503): only the
            # benchmark's pools must be listed with a routable endpoint of each role.
            if (status == 200 or pools) and all(
                name in listed
                and listed[name].get("context", {}).get("routable", 0) > 0
                and listed[name].get("generation", {}).get("routable", 0) > 0
                for name in pools
            ):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"gateway not ready (last /ready: {last}):\n{gateway.log_tail()}")


def sim_stats(url: str) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    return http_get_json(port, "/sim/stats")[1]


def start_sim_pair(stack: Stack, **options: Any) -> tuple[SimProc, SimProc]:
    """A context and a generation sim worker with the same options."""
    return stack.start_simworker("context", **options), stack.start_simworker("generation", **options)


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


class Profiler:
    """`py-spy record` on one process, collapsed stacks, and a top-functions summary."""

    def __init__(self, pid: int, name: str, rate: int = int(os.environ.get("BENCH_PROFILE_RATE", "250"))) -> None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        self.path = RESULTS_DIR / f"{name}.txt"
        spy = Path(PYTHON).parent / "py-spy"
        exe = str(spy) if spy.exists() else shutil.which("py-spy")
        if exe is None:
            raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
        self.process = subprocess.Popen(
            [exe, "record", "-p", str(pid), "-r", str(rate), "-f", "raw", "-o", str(self.path), "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)

    def stop(self, top: int = 25) -> None:
        if self.process.poll() is None:
            self.process.send_signal(2)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        summarize_profile(self.path, top)


@contextlib.contextmanager
def profiled(pids: Sequence[int], name: str, enabled: bool) -> Iterator[None]:
    """Profile the processes `pids` (names `<name>-<i>`) for the duration of the block, if enabled."""
    profilers = [Profiler(pid, name if len(pids) == 1 else f"{name}-{i}") for i, pid in enumerate(pids)] if enabled else []
    try:
        yield
    finally:
        for profiler in profilers:
            profiler.stop()


def summarize_profile(path: Path, top: int = 25) -> None:
    """Self and inclusive sample shares per function from py-spy's collapsed (raw) output."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        print(f"(no profile at {path})")
        return
    total = 0
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")" if " (" in f else f
                  for f in stack.split(";")]
        # Idle threads (the event loop in select/epoll, executor threads waiting) are not work.
        leaf = frames[-1]
        if any(k in leaf for k in ("select (", "poll (", "wait (", "_worker (", "get (queue")):
            continue
        total += count
        own[leaf] = own.get(leaf, 0) + count
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + count
    if not total:
        print("(empty profile)")
        return
    print(f"\nprofile: {total} busy samples ({path.relative_to(PROJECT_ROOT)})")
    print("  self %   function")
    for name, count in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * count / total:6.1f}   {name}")
    print("  incl %   function")
    for name, count in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * count / total:6.1f}   {name}")


# --- request bodies --------------------------------------------------------------------------------


def messages_body(directive: str, *, stream: bool, model: str = MODEL, max_tokens: int = 100000, text: str = "Hello") -> bytes:
    return json.dumps(
        {
            "model": model,
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": f"{text} {directive}".strip()}],
        },
        separators=(",", ":"),
    ).encode()


def build_request(method: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: 127.0.0.1:{port}", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def gateway_request(port: int, key: str, body: bytes) -> bytes:
    return build_request(
        "POST",
        port,
        "/v1/messages",
        body,
        {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"},
    )


def worker_request(port: int, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return build_request("POST", port, "/v1/chat/completions", body, {"content-type": "application/json"})


def port_of(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


# --- a lean raw HTTP/1.1 client ----------------------------------------------------------------------


@dataclass(slots=True)
class Response:
    """One response as the client saw it. Times are `time.perf_counter()` values."""

    sent_at: float = 0.0
    status_at: float | None = None
    status: int = 0
    headers: bytes = b""
    done_at: float | None = None
    body: bytearray | None = None  # kept only when asked for
    frames: list[tuple[float, bytes]] | None = None  # (arrival, event name) when asked for
    count: int = 0  # occurrences of the counted pattern in the body
    first_count_at: float | None = None  # arrival of the first occurrence
    count_times: list[float] | None = None  # arrival of every read holding occurrences, when asked
    max_count_gap: float = 0.0  # longest time between two reads holding occurrences
    error: str | None = None


class HttpConnection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection that sends one request at a time.

    Parsing is minimal on purpose (the load generator shares 2 cores with the system under test):
    the status line, the two framing headers, and a chunked or Content-Length body. Per response
    it can keep the body, split it into SSE frames (event name and arrival time), or only count a
    byte pattern (e.g. `event: content_block_delta`) and note when it first arrived.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._buf = b""
        self._resp: Response | None = None
        self._future: asyncio.Future[Response] | None = None
        self._state = 0  # 0 head, 1 content-length body, 2 chunked body
        self._remaining = 0
        self._decoder = ChunkedDecoder()
        self._keep_body = False
        self._frames = False
        self._sse = b""
        self._pattern = b""
        self._tail = b""
        self._last_count_at = 0.0
        self.server_closes = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self._future is not None and not self._future.done():
            resp = self._resp
            assert resp is not None
            # A Content-Length-less, non-chunked body ends with the connection.
            if resp.status and self._state == 1 and self._remaining < 0:
                resp.done_at = time.perf_counter()
                self._future.set_result(resp)
            else:
                resp.error = f"connection lost ({exc or 'closed by server'}) in state {self._state}"
                self._future.set_result(resp)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        resp = self._resp
        if resp is None:
            return
        if resp.status_at is None:
            resp.status_at = now
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos = 0
        n = len(buf)
        while pos < n:
            state = self._state
            if state == 2:  # chunked body (the product's decoder: per read as cheap as a hand-written one)
                payload = self._decoder.feed(buf[pos:] if pos else buf)
                pos = n
                if payload:
                    self._on_body(payload, now)
                if self._decoder.done:
                    self._finish(now)  # nothing may follow an unpipelined response
                continue
            if state == 1:  # content-length body
                if self._remaining < 0:  # read until close
                    self._on_body(buf[pos:], now)
                    pos = n
                    continue
                take = min(self._remaining, n - pos)
                self._on_body(buf[pos : pos + take], now)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._finish(now)
                    pos = n
                continue
            # state 0: head
            end = buf.find(b"\r\n\r\n", pos)
            if end < 0:
                break
            head = buf[pos:end]
            pos = end + 4
            resp.status = int(head[9:12])
            lower = head.lower()
            resp.headers = head
            self.server_closes = b"\r\nconnection: close" in lower
            if b"\r\ntransfer-encoding: chunked" in lower:
                self._state = 2
                self._decoder = ChunkedDecoder()
            else:
                i = lower.find(b"\r\ncontent-length:")
                if i >= 0:
                    j = lower.find(b"\r\n", i + 2)
                    self._remaining = int(lower[i + 17 : j if j >= 0 else len(lower)].strip())
                    self._state = 1
                    if self._remaining == 0:
                        self._finish(now)
                        pos = n
                else:
                    self._remaining = -1
                    self._state = 1
        if pos < n:
            self._buf = buf[pos:]

    # body handling

    def _on_body(self, data: bytes, now: float) -> None:
        resp = self._resp
        assert resp is not None
        if self._keep_body:
            assert resp.body is not None
            resp.body += data
        if self._pattern:
            text = self._tail + data if self._tail else data
            found = text.count(self._pattern)
            if found:
                if resp.first_count_at is None:
                    resp.first_count_at = now
                else:
                    gap = now - self._last_count_at
                    if gap > resp.max_count_gap:
                        resp.max_count_gap = gap
                self._last_count_at = now
                if resp.count_times is not None:
                    resp.count_times.extend((now,) * found)
                resp.count += found
            keep = len(self._pattern) - 1
            # Keep a tail so a pattern split across two reads is still seen (once).
            self._tail = text[-keep:] if len(text) >= keep else text
        if self._frames:
            assert resp.frames is not None
            sse = self._sse + data if self._sse else data
            start = 0
            while True:
                end = sse.find(b"\n\n", start)
                if end < 0:
                    break
                frame = sse[start:end]
                start = end + 2
                name = b""
                if frame.startswith(b"event: "):
                    nl = frame.find(b"\n")
                    name = frame[7 : nl if nl >= 0 else len(frame)]
                elif frame.startswith(b"data: "):
                    name = b"data"
                elif frame.startswith(b":"):
                    name = b"comment"
                resp.frames.append((now, name))
            self._sse = sse[start:]

    def _finish(self, now: float) -> None:
        resp = self._resp
        assert resp is not None and self._future is not None
        resp.done_at = now
        self._resp = None
        future, self._future = self._future, None
        if not future.done():
            future.set_result(resp)
        if self.server_closes and self.transport is not None:
            self.transport.close()

    # API

    def request(
        self, wire: bytes, *, keep_body: bool = False, frames: bool = False, count: bytes = b"", count_times: bool = False
    ) -> asyncio.Future[Response]:
        """Send one request; the future resolves with its Response when the body is complete."""
        assert self._future is None, "one request at a time"
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._future = loop.create_future()
        resp = Response(
            body=bytearray() if keep_body else None, frames=[] if frames else None, count_times=[] if count_times else None
        )
        self._resp = resp
        self._state = 0
        self._buf = b""
        self._sse = b""
        self._tail = b""
        self._keep_body = keep_body
        self._frames = frames
        self._pattern = count
        resp.sent_at = time.perf_counter()
        self.transport.write(wire)
        return self._future

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self.server_closes

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(port: int, host: str = "127.0.0.1") -> HttpConnection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(HttpConnection, host, port)
    return protocol


class KeepAlive:
    """One reusable connection to a port, reconnecting when the server closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: HttpConnection | None = None

    async def request(self, wire: bytes, **kwargs: Any) -> Response:
        if self.conn is None or not self.conn.usable:
            if self.conn is not None:
                self.conn.close()
            self.conn = await connect(self.port)
        return await self.conn.request(wire, **kwargs)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# --- statistics and tables ---------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 100]."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low))


def distribution(values: Iterable[float]) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {"n": 0}
    return {
        "n": len(data),
        "min": float(data[0]),
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "max": float(data[-1]),
        "mean": sum(data) / len(data),
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> None:
    cells = [[_fmt(c, digits) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    line = "  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(headers))
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))


DIST_HEADERS = ("", "n", "min", "p50", "p90", "p99", "max")


def dist_row(label: str, dist: dict[str, float], scale: float = 1.0) -> list[Any]:
    if not dist.get("n"):
        return [label, 0, "-", "-", "-", "-", "-"]
    return [label, int(dist["n"])] + [dist[k] * scale for k in ("min", "p50", "p90", "p99", "max")]


def print_distributions(title: str, rows: Sequence[tuple[str, dict[str, float]]], unit_scale: float = 1.0, digits: int = 2) -> None:
    print_table(title, DIST_HEADERS, [dist_row(label, d, unit_scale) for label, d in rows], digits)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def machine_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg(),
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    data = {"benchmark": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(), **data}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nresult written to {path.relative_to(PROJECT_ROOT)}")
    return path


def in_ms(d: dict[str, float]) -> dict[str, float]:
    """A distribution of seconds as milliseconds (for JSON output)."""
    return {k: (v * 1000 if k != "n" else v) for k, v in d.items()}


__all__ = [
    "MODEL",
    "CpuMeter",
    "GatewayProc",
    "HttpConnection",
    "KeepAlive",
    "Response",
    "SimProc",
    "Stack",
    "add_common_arguments",
    "build_request",
    "connect",
    "distribution",
    "gateway_request",
    "hwm_mib",
    "in_ms",
    "messages_body",
    "port_of",
    "print_distributions",
    "print_table",
    "proc_cpu_seconds",
    "proc_memory_kib",
    "raise_nofile",
    "resolve",
    "result_name",
    "rss_mib",
    "self_cpu_seconds",
    "sim_stats",
    "start_sim_pair",
    "verdict",
    "worker_request",
    "write_result",
]
