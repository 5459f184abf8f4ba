"""`manage.py serve`: several daphne processes on one port, and the SIGTERM drain."""

from __future__ import annotations

import inspect
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from daphne.http_protocol import HTTPFactory
from daphne.server import Server

from messages_api.models import MessageRequest
from tests.support.cluster import Cluster, audit_row, register_cluster, reservations_closed, wait_until
from tests.support.gateway import PROJECT_ROOT, gateway_env
from tests.support.rawclient import RawStream
from tests.support.simworkers import SimWorker
from workers.sim.process import stop_process

pytestmark = pytest.mark.django_db(transaction=True)


class Served:
    """`manage.py serve --port 0` as a process; `url` once it announced its port."""

    def __init__(self, processes: int, **env: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", "0", "--processes", str(processes),
             "--", "--application-close-timeout", "5"],
            cwd=PROJECT_ROOT,
            env=gateway_env(env),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("gateway on http://"), line
        self.url = line.split()[2]
        self.port = int(self.url.rsplit(":", 1)[1])
        wait_until(self._answers, timeout=30, message="the served gateway never answered")

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        stop_process(self.process)


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    options: dict[str, Any] = dict(getattr(request, "param", {}))
    server = Served(int(options.pop("processes", 2)), **options)
    yield server
    server.stop()


def registered_everywhere(served: Served, cluster: Cluster) -> None:
    """Each process refreshes its registry on its own: wait until every connection sees the pool."""

    def seen() -> bool:
        for _ in range(10):  # a new connection each time: it may land on either process
            pools = httpx.get(served.url + "/ready", timeout=5).json()["pools"]
            if pools.get(cluster.pool.name, {}).get("id") != cluster.pool.id:
                return False
        return True

    wait_until(seen, timeout=10)


def open_stream(served: Served, cluster: Cluster, text: str) -> RawStream:
    return RawStream.post_json(
        served.url + "/v1/messages",
        {"model": cluster.model, "max_tokens": 4000, "stream": True, "messages": [{"role": "user", "content": text}]},
        cluster.headers(),
    )


def test_both_processes_serve_and_each_sees_its_own_clients_leave(
    served: Served, transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    cluster = register_cluster(context_worker, generation_worker)
    registered_everywhere(served, cluster)

    def one(_: int) -> str:
        response = httpx.post(
            served.url + "/v1/messages",
            json={"model": cluster.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi [sim tokens=2 context_delay=0.2]"}]},
            headers=cluster.headers(),
            timeout=30,
        )
        assert response.status_code == 200, response.text
        return str(response.headers["request-id"])

    def instances() -> set[str]:
        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(one, range(8)))
        return {audit_row(rid).gateway_instance for rid in ids}

    # The kernel gives each connection to whichever process accepts first: concurrent requests
    # land on both (a batch on one alone is possible, rarely twice in a row).
    wait_until(lambda: len(instances()) == 2, timeout=30, message="one process served everything")

    # A client leaving mid-context is seen by the process holding its connection, whichever it is.
    streams = [open_stream(served, cluster, "hold [sim context_delay=30]") for _ in range(6)]
    for stream in streams:
        stream.read_head()
    request_ids = [s.response_headers["request-id"] for s in streams]
    for stream in streams:
        stream.close()
    rows = [audit_row(rid) for rid in request_ids]
    assert {row.status for row in rows} == {"cancelled"}
    for rid in request_ids:
        assert {r.outcome for r in reservations_closed(rid)} == {"cancelled"}
    context_worker.wait_for(lambda st: st["aborted"] >= 6 and st["active"] == 0)


def accept_queues(port: int) -> list[int]:
    """The accept queue's length of every IPv4 socket listening on `port` (/proc/net/tcp: a
    listening socket's rx_queue is its backlog of connections not yet accepted)."""
    queues = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            queues.append(int(fields[4].split(":")[1], 16))
    return queues


def test_connections_opened_together_are_spread_evenly(
    served: Served, transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    """A socket per process (SO_REUSEPORT): connections that arrive together are not all taken by
    whichever process wakes first (from one shared socket, Twisted accepts up to a hundred per
    wake-up). The processes are stopped while the connections arrive, so they wait in the backlog
    together, as in a burst; then one process runs alone until it has accepted what it can."""
    cluster = register_cluster(context_worker, generation_worker)
    registered_everywhere(served, cluster)
    children = [int(pid) for pid in Path(f"/proc/{served.process.pid}/task/{served.process.pid}/children").read_text().split()]
    assert len(children) == 2
    body = orjson.dumps({"model": cluster.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi [sim tokens=2]"}]})
    head = "".join(f"{name}: {value}\r\n" for name, value in cluster.headers().items())
    request = (f"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n{head}"
               f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    try:
        connections = [socket.create_connection(("127.0.0.1", served.port), timeout=30) for _ in range(40)]
        for conn in connections:
            conn.sendall(request)
        os.kill(children[0], signal.SIGCONT)
        wait_until(lambda: 0 in accept_queues(served.port), timeout=10, message="the first process accepted nothing")
    finally:
        for pid in children:
            os.kill(pid, signal.SIGCONT)
    ids = []
    for conn in connections:
        with conn:
            answer = b"".join(iter(lambda c=conn: c.recv(65536), b""))  # type: ignore[misc]
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        ids.append(re.search(rb"(?im)^request-id: *(\S+)", answer).group(1).decode())  # type: ignore[union-attr]
    served_by = Counter(audit_row(rid).gateway_instance for rid in ids)
    # By the hash of each connection's addresses: fewer than 8 of 40 on one process has p < 1e-4.
    assert len(served_by) == 2 and min(served_by.values()) >= 8, served_by


@pytest.mark.parametrize("served", [{"GATEWAY_DRAIN_TIMEOUT_S": "20"}], indirect=True)
def test_sigterm_drains_then_exits(
    served: Served, transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    cluster = register_cluster(context_worker, generation_worker)
    registered_everywhere(served, cluster)
    # In flight when the signal comes: its first token is 1.5 s away.
    stream = open_stream(served, cluster, "slow [sim tokens=5 gen_delay=1.5]")
    assert stream.read_head() == 200
    request_id = stream.response_headers["request-id"]
    served.process.send_signal(signal.SIGTERM)

    # No new connections once every process stopped listening ...
    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", served.port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    wait_until(refused, timeout=10, message="still accepting connections after SIGTERM")
    # ... while the stream in flight finishes whole.
    events = [frame.event for frame in stream.read_all()]
    assert events[-1] == "message_stop" and "error" not in events, events
    assert served.process.wait(timeout=15) == 0
    row = audit_row(request_id)
    assert row.status == "completed"
    assert {r.outcome for r in reservations_closed(request_id)} == {"success"}
    assert MessageRequest.objects.filter(request_id=request_id).count() == 1


def test_daphnes_http_factory_is_built_with_its_server() -> None:
    # The drain finds the server as each listening port's `factory.server`; that the names exist is
    # tests/unit/disagg_project/test_relied_on.py's check.
    assert HTTPFactory.__init__.__code__.co_varnames[1] == "server"
    assert "def run" in inspect.getsource(Server)


@pytest.mark.parametrize("served", [{"GATEWAY_DRAIN_TIMEOUT_S": "20", "processes": 1}], indirect=True)
def test_a_draining_process_says_so_on_ready(
    served: Served, transactional_db: Any, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    """A load balancer still holding a keep-alive connection to a draining process must stop
    choosing it: /ready answers 503 "draining" there while a stream finishes."""
    cluster = register_cluster(context_worker, generation_worker)
    registered_everywhere(served, cluster)
    with httpx.Client(base_url=served.url, timeout=5) as probe:
        # One process (so the probe's connection and the streams share it), draining a while.
        streams = [open_stream(served, cluster, "slow [sim tokens=3 gen_delay=3]") for _ in range(2)]
        for stream in streams:
            stream.read_head()
        assert probe.get("/ready").status_code == 200  # the probe's connection is now open
        served.process.send_signal(signal.SIGTERM)
        answer = wait_until(lambda: (r := probe.get("/ready")).status_code == 503 and r, timeout=10)
        assert answer.json()["status"] == "draining"
        for stream in streams:
            assert [f.event for f in stream.read_all()][-1] == "message_stop"
    assert served.process.wait(timeout=15) == 0
