"""Hosts for a test, made as Linux network namespaces on one machine (`ip netns`, veth pairs, a
bridge), and what processes on them need of the root namespace's services.

    with network("hostA", "hostB") as net:      # skips (or fails, with REQUIRE_NETNS=1) without the capability
        net.hub                                  # the root namespace's address on the bridge
        net.address("hostA")                     # hostA's address
        gateway = net.gateway("hostA", env)      # a gateway process living on hostA
        with redis_server(net.hub) as url: ...   # a Redis of the test's own, on the bridge

Each host is a namespace of its own whose only interface (besides its loopback) is one end of a
veth pair; the other end is on a bridge in the root namespace, which holds the hub address on a
private /24. A process on a host therefore reaches the root namespace (and the engines a test
binds to the hub address) only over its link, and 127.0.0.1 there is the host's own loopback:
the machine's Redis and PostgreSQL (which listen on loopback) are out of its reach, so a test
runs a Redis on the hub address and relays the database (`database_url`).

Names carry this process's id and a counter, so concurrent runs never share one, and the
namespaces and links of a run that died without its cleanup (SIGKILL) are swept by the next one.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.support.gateway import Gateway, test_database_url
from tests.support.ports import unused_port
from tests.support.waiting import poll

__all__ = ["Network", "Relay", "database_url", "network", "redis_server"]

REQUIRE_ENV = "REQUIRE_NETNS"
CLONE_NEWNET = 0x40000000
_PREFIX = "gwt"  # namespaces gwt<pid>n<k>-<host>, bridges gwb<pid>n<k>, veths gwv<pid>n<k><i>
_OURS = re.compile(r"^gw[tbv](\d+)n\d+")
_runs = itertools.count(1)
#: What `ip` says on a machine (a container) that withholds the capability even from root.
_NOT_PERMITTED = re.compile(r"not permitted|permission denied", re.IGNORECASE)


class NetnsUnavailable(Exception):
    """The machine will not make network namespaces for this process (not root, no `ip`, or a
    container without CAP_NET_ADMIN / CAP_SYS_ADMIN)."""


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep() -> None:
    """Delete the namespaces and links of runs whose process is gone (killed before cleanup)."""
    stale_namespaces = [name for name in _ip("netns", "list").split() if (m := _OURS.match(name)) and not _alive(int(m[1]))]
    for name in stale_namespaces:  # its veth ends go with it, and their peers on the bridge
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    for line in _ip("-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if (m := _OURS.match(name)) and not _alive(int(m[1])):
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=10)


def _free_subnet() -> str:
    """A /24 in 10.200-254.x.0 that no route or address of the machine touches (the first three
    octets)."""
    taken = _ip("-4", "route", "show", "table", "all") + _ip("-4", "addr", "show")
    for _ in range(100):
        subnet = f"10.{random.randint(200, 254)}.{random.randint(0, 255)}"
        if f"{subnet}." not in taken:
            return subnet
    raise NetnsUnavailable("no free 10.x.y.0/24 for the test network")


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    return None


def _skip_or_fail(reason: str) -> NoReturn:
    message = f"no network namespaces: {reason}"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(message + f" ({REQUIRE_ENV} is set)")
    pytest.skip(message)


@dataclass
class Network:
    """Hosts on one bridge; `hub` is the root namespace's address there."""

    tag: str
    bridge: str
    hub: str
    namespaces: dict[str, str] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def address(self, host: str) -> str:
        return self.addresses[host]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host` (`ip netns exec` execs it: the process's id is the command's)."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def peers(self, host: str) -> set[tuple[str, int]]:
        """The (address, port) at the far end of each TCP connection established on `host`."""
        lines = subprocess.run(
            self.command(host, ["ss", "-Htn", "state", "established"]), capture_output=True, text=True, timeout=10, check=True
        ).stdout.splitlines()
        far = (line.split()[-1].rsplit(":", 1) for line in lines if line.strip())
        return {(address.strip("[]"), int(port)) for address, port in far}

    def listen(self, host: str, backlog: int = 1024) -> socket.socket:
        """A listening TCP socket on the host's address, port chosen by the host's kernel.

        Made on a thread that enters the host's namespace (setns affects only the calling thread)
        and ends there, so the test's own threads never change namespace."""
        made: list[socket.socket | BaseException] = []

        def enter_and_bind() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                with open(f"/run/netns/{self.namespaces[host]}", "rb") as ns:
                    if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                        errno = ctypes.get_errno()
                        raise OSError(errno, f"setns into {self.namespaces[host]}: {os.strerror(errno)}")
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.addresses[host], 0))
                sock.listen(backlog)
                made.append(sock)
            except BaseException as exc:  # re-raised on the caller's thread
                made.append(exc)

        thread = threading.Thread(target=enter_and_bind, name=f"netns-{host}")
        thread.start()
        thread.join()
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    def gateway(self, host: str, env: dict[str, str]) -> Gateway:
        """A gateway process (not started) on `host`: it listens on the host's address, and every
        connection it makes (database, Redis, workers, KV events) leaves from the host. Clients
        name it by its address (its `Host` header), which it allows; `/metrics`, served without a
        token to loopback clients only, takes this network's (`gateway.env["METRICS_TOKEN"]`)."""
        env = {"ALLOWED_HOSTS": self.addresses[host], "METRICS_TOKEN": f"metrics-{self.tag}", **env}
        gateway = Gateway(env, sock=self.listen(host), command_prefix=self.command(host, []))
        gateway.log_path = gateway.log_path.with_name(f"test-daphne-{os.getpid()}-{self.namespaces[host]}.log")
        return gateway


def _teardown(tag: str) -> None:
    """Delete everything named for this run: its namespaces (their veth ends, and so the peers on
    the bridge, go with them), then the bridge. Errors are ignored: each step is tried."""
    for name in _ip("netns", "list").split():
        if name.startswith(f"{_PREFIX}{tag}-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    for kind in ("v", "b"):  # a veth left in the root namespace if its namespace was never made
        for line in _ip("-o", "link", "show").splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(f"gw{kind}{tag}"):
                subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=10)


@contextmanager
def network(*hosts: str) -> Iterator[Network]:
    """The hosts as namespaces on a bridge; deleted on exit, however the block ends. Skips the
    test (fails it with REQUIRE_NETNS=1) where namespaces cannot be made."""
    if reason := unavailable_reason():
        _skip_or_fail(reason)
    tag = f"{os.getpid()}n{next(_runs)}"
    _sweep()
    subnet = _free_subnet()
    net = Network(tag=tag, bridge=f"gwb{tag}", hub=f"{subnet}.1")
    try:
        try:
            _build(net, subnet, hosts)
        except NetnsUnavailable as exc:
            if not _NOT_PERMITTED.search(str(exc)):
                raise  # a real failure, not a machine without the capability
            _skip_or_fail(str(exc))
        yield net
    finally:
        _teardown(tag)


def _build(net: Network, subnet: str, hosts: Sequence[str]) -> None:
    _ip("link", "add", net.bridge, "type", "bridge")
    _ip("addr", "add", f"{net.hub}/24", "dev", net.bridge)
    _ip("link", "set", net.bridge, "up")
    for i, host in enumerate(hosts, start=2):
        namespace, veth, peer = f"{_PREFIX}{net.tag}-{host}", f"gwv{net.tag}{i}", f"gwp{net.tag}{i}"
        _ip("netns", "add", namespace)
        net.namespaces[host], net.addresses[host] = namespace, f"{subnet}.{i}"
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer, "netns", namespace)
        _ip("link", "set", veth, "master", net.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", namespace, "link", "set", peer, "name", "eth0")
        _ip("-n", namespace, "addr", "add", f"{net.addresses[host]}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")


class Relay:
    """TCP connections to `listen` (an address on the bridge) forwarded to `target` (a service the
    root namespace has on its loopback), one pair of threads per connection."""

    def __init__(self, listen: str, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server((listen, 0))
        self.address: tuple[str, int] = self.server.getsockname()[:2]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), name="relay-pump", daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            # Each side's pump closes its source when it ends; the other side then sees EOF or an error.
            with self._lock:
                self._open.discard(source)
            source.close()

    def close(self) -> None:
        self.server.close()
        with self._lock:
            for sock in self._open:
                sock.close()
            self._open.clear()


@contextmanager
def database_url(hub: str) -> Iterator[str]:
    """The test database's URL as a host on the bridge reaches it: the SQLite file as it is (a
    file is no network's), PostgreSQL through a relay on the hub address to the root namespace's
    server (the same database, the test run's own)."""
    url = test_database_url()
    if url.startswith("sqlite:"):
        yield url
        return
    parts = urlsplit(url)
    relay = Relay(hub, (parts.hostname or "127.0.0.1", parts.port or 5432))
    auth = parts.netloc.rpartition("@")[0]
    try:
        yield urlunsplit(parts._replace(netloc=f"{auth + '@' if auth else ''}{relay.address[0]}:{relay.address[1]}"))
    finally:
        relay.close()


def _pings(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, however it dies (a Redis nobody stops)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextmanager
def redis_server(address: str) -> Iterator[str]:
    """A Redis of the test's own, listening on `address` only (no persistence); its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        _skip_or_fail("redis-server is not installed (a test network's Redis)")
    port = unused_port()
    process = subprocess.Popen(
        [binary, "--bind", address, "--port", str(port), "--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
    )  # fmt: skip
    try:
        poll(lambda: process.poll() is None and _pings(address, port), bool, timeout=15, what=f"redis-server on {address}:{port}")
        yield f"redis://{address}:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
