"""One benchmark's world as processes: a temporary directory and database, sim workers, gateways
(daphne on a socket bound here, `--fd`), the Rust routers and the floor proxies; all stopped
when the script ends, however it ends."""

from __future__ import annotations

import atexit
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from messages_api.server.listeners import bind_listeners
from tests.support.ports import unused_port
from workers.sim.process import stop_process

from .bodies import port_of
from .limits import child_setup, raise_nofile
from .paths import PROJECT_ROOT, PYTHON
from .proc import proc_cpu_seconds

LISTEN_BACKLOG = 4096


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
    #: The listening sockets the processes accept from (one each, or one shared).
    socks: list[socket.socket] = field(default_factory=list)
    port: int = 0
    #: The other daphne processes on the same port (`start_gateway(processes=N)`).
    siblings: list[Proc] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        """Every process of this gateway, the first one's pid first."""
        return [self.pid, *(sibling.pid for sibling in self.siblings)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        super().stop()
        for sock in self.socks:
            sock.close()
        self.socks = []


@dataclass
class RouterProc(Proc):
    port: int = 0


# How each router is started; the arguments after these are the same for both.
ROUTERS: dict[str, list[str]] = {
    "vllm-router": [str(Path(PYTHON).parent / "vllm-router")],
    "sglang-router": [PYTHON, "-m", "sglang_router.launch_router"],
}


FLOORS = ("pipe", "reframe", "pipe-uvloop", "reframe-uvloop", "framework")


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
            preexec_fn=child_setup,
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
            args, cwd=PROJECT_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_setup
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
        processes: int = 1,
        shared_socket: bool = False,
        wrapper: Sequence[str] = (),
        ready_timeout: float = 60.0,
        application: str = "disagg_project.asgi:application",
        daphne_args: Sequence[str] = (),
    ) -> GatewayProc:
        """daphne on a socket bound here and passed with `--fd`; waits until /ready lists the pools.

        `processes`: that many daphnes on one port, as `manage.py serve --processes N` runs them
        in production: a socket each with SO_REUSEPORT (messages_api/server/listeners.py), or with
        `shared_socket` (`serve --shared-socket`) one socket they all accept from.

        `root`: run the gateway from another checkout of the project (an A/B comparison with
        another commit, on the same database and workers).

        daphne (Twisted) leaves Nagle's algorithm on for the connections it accepts; `nodelay`
        (default: the Stack's `gateway_nodelay`) sets TCP_NODELAY on the listening socket, which
        Linux copies to every accepted connection.

        `wrapper`: a command the gateway runs under (`harness.instructions.callgrind_command`),
        given `ready_timeout` seconds to start.

        `application`: the ASGI application daphne serves (`bench/framework_floor.py`'s, to measure
        daphne and Channels alone); it must answer GET /ready. `daphne_args`: more of daphne's options.
        """
        socks = bind_listeners("127.0.0.1", 0, 1 if shared_socket else processes, LISTEN_BACKLOG)
        if self.gateway_nodelay if nodelay is None else nodelay:
            for sock in socks:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        port = socks[0].getsockname()[1]
        env = dict(self.env)
        for key, value in (settings or {}).items():
            env[key] = str(value)
        started: list[tuple[subprocess.Popen[bytes], Path]] = []
        for i in range(processes):
            log_path = self.tmp / (f"daphne-{port}.log" if i == 0 else f"daphne-{port}-{i}.log")
            log = open(log_path, "wb")
            fd = socks[i % len(socks)].fileno()
            process = subprocess.Popen(
                [*wrapper, PYTHON, "-m", "daphne", *daphne_args, "--fd", str(fd), application],
                cwd=root or PROJECT_ROOT,
                env=env,
                pass_fds=[fd],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=child_setup,
            )
            log.close()
            started.append((process, log_path))
        (process, log_path), rest = started[0], started[1:]
        siblings = [Proc(name=f"daphne-{port}-{i + 1}", process=p, log_path=path) for i, (p, path) in enumerate(rest)]
        gateway = GatewayProc(name=f"daphne-{port}", process=process, log_path=log_path, socks=socks, port=port, siblings=siblings)
        self.procs.extend([*siblings, gateway])
        wait_ready(gateway, set(expect_pools), timeout=ready_timeout)
        for sibling in siblings:
            # /ready answers from whichever process accepted: the others are up when their
            # start-up's CPU has stopped growing.
            wait_settled(sibling)
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
            raise RuntimeError(f"{kind} is not installed (requirements-dev.txt pins it: make install-dev)")
        env = {k: v for k, v in self.env.items() if "proxy" not in k.lower()}
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = "http://127.0.0.1:9"
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
        log_path = self.tmp / f"{kind}-{port}.log"
        log = open(log_path, "wb")
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=child_setup)
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

    def start_floor(self, variant: str, worker_url: str) -> RouterProc | GatewayProc:
        """bench/floor_proxy.py in front of one worker; `variant` is one of FLOORS
        (pipe, reframe, pipe-uvloop, reframe-uvloop). Waits for its listening line.
        `framework`: daphne serving bench/framework_floor.py's relay (the least a relay on the
        gateway's stack does: Messages in, the worker's stream over aiohttp, Anthropic events out)."""
        if variant not in FLOORS:
            raise ValueError(f"unknown floor {variant!r}; one of {FLOORS}")
        if variant == "framework":
            return self.start_gateway({"FRAMEWORK_FLOOR": "relay", "FLOOR_UPSTREAM": worker_url},
                                      application="bench.framework_floor:application", daphne_args=("-v", "0"))
        mode, _, loop = variant.partition("-")
        command = [PYTHON, str(PROJECT_ROOT / "bench" / "floor_proxy.py"), "--mode", mode, "--upstream", worker_url]
        if loop == "uvloop":
            command.append("--uvloop")
        log_path = self.tmp / f"floor-{variant}.log"
        log = open(log_path, "wb")
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=child_setup)
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


def wait_settled(proc: Proc, timeout: float = 60.0, quiet_s: float = 0.3) -> None:
    """Wait until a starting process stops using CPU (its imports and set-up are done)."""
    deadline = time.monotonic() + timeout
    last = proc_cpu_seconds(proc.pid)
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log_tail()}")
        time.sleep(quiet_s)
        now = proc_cpu_seconds(proc.pid)
        if now - last < 0.01:
            return
        last = now
    raise RuntimeError(f"{proc.name} kept using CPU for {timeout:g} s after it started")


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
