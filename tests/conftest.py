"""Shared fixtures: real sim worker processes, real daphne gateways, and a registered pool."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import settings

from tests.gateway import Gateway
from tests.simworkers import SimWorker, start_simworker

# No per-example deadline for hypothesis: its 200 ms default measures the machine, not the code.
# This 2-core machine stalls every process for seconds while a real vLLM engine starts or decodes
# (an 18.8 s stall failed a pure-function property test in CI, 2026-12-03).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

MODEL = "sim-model"
# Fast sim workers: tests wait for conditions, so only the fault directives add time.
SIM_OPTIONS = {"tokens_per_second": 2000, "prefill_tokens_per_second": 200000, "max_context_tokens": 4096, "kv_timeout": 30}
# The sims check signed handoffs (TensorRT-LLM's internal_request_auth_key) and the pools
# register_cluster makes share the key, so the whole suite runs signed.
SIGNING_KEY = "test-handoff-signing-key"
SIM_ENV = {"INTERNAL_REQUEST_AUTH_KEY": SIGNING_KEY}


def sim_worker(role: str) -> Iterator[SimWorker]:
    """The body of a fixture that runs one sim worker for its scope."""
    worker = start_simworker(role, env=SIM_ENV, **SIM_OPTIONS)
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def context_worker() -> Iterator[SimWorker]:
    yield from sim_worker("context")


@pytest.fixture(scope="session")
def generation_worker() -> Iterator[SimWorker]:
    yield from sim_worker("generation")


@pytest.fixture(scope="session")
def sim_pair() -> Iterator[Callable[..., tuple[SimWorker, SimWorker]]]:
    """`sim_pair("vllm")`: a context and a generation sim speaking that protocol's dialect,
    started on first use and kept for the session (`**options` override SIM_OPTIONS; each
    distinct set of options is its own pair)."""
    started: dict[str, tuple[SimWorker, SimWorker]] = {}

    def get(protocol: str, **options: Any) -> tuple[SimWorker, SimWorker]:
        merged = {**SIM_OPTIONS, **options, "protocol": protocol}
        key = repr(sorted(merged.items()))
        if key not in started:
            started[key] = (
                start_simworker("context", env=SIM_ENV, **merged),
                start_simworker("generation", env=SIM_ENV, **merged),
            )
        return started[key]

    yield get
    for pair in started.values():
        for worker in pair:
            worker.stop()


@pytest.fixture(autouse=True)
async def close_worker_transport() -> AsyncIterator[None]:
    """A test that calls workers in-process gets its loop's connection pools; close them with it."""
    yield
    from workers.wire.client import close_transport

    await close_transport()


@pytest.fixture(scope="session", autouse=True)
def release_test_database(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    """Before pytest-django drops the test database: write what is queued, and close the
    connections this process's threads (the row writer, executor threads) still hold, which would
    otherwise keep PostgreSQL from dropping it."""
    yield
    from django.db import connection

    from workers.cluster.writer import get_writer

    with django_db_blocker.unblock():
        get_writer().flush()
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )


@pytest.fixture(scope="session")
def gateways(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Callable[..., Gateway]]:
    """`gateways(**env)` → a running gateway with those settings (one per distinct env)."""
    running: dict[tuple[tuple[str, str], ...], Gateway] = {}

    def get(**env: str) -> Gateway:
        key = tuple(sorted(env.items()))
        if key not in running:
            with django_db_blocker.unblock():
                running[key] = Gateway(env).start()
        return running[key]

    yield get
    for gateway in running.values():
        gateway.stop()


@pytest.fixture
def gateway(gateways: Callable[..., Gateway]) -> Gateway:
    return gateways()


@pytest.fixture
def patient_gateway(gateways: Callable[..., Gateway]) -> Gateway:
    """A gateway whose stream-start wait (10 s) outlasts any stall of a loaded test machine.

    Tests that a worker's immediate failure reaches a streamed client as an HTTP error, before the
    status line, use it: under the suite's 0.3 s wait a busy CI run once sent the status line and
    a ping first, and the same failure arrived as an error event instead."""
    return gateways(MESSAGES_STREAM_START_WAIT_S="10")


@dataclass
class Cluster:
    """A registered pool of one sim context and one sim generation worker, and an API key."""

    pool: Any
    key: str
    model: str
    context: SimWorker
    generation: SimWorker

    def headers(self, **extra: str) -> dict[str, str]:
        return {"x-api-key": self.key, "anthropic-version": "2023-06-01", "content-type": "application/json", **extra}


def register_cluster(
    context: SimWorker,
    generation: SimWorker,
    *,
    schedule_style: str = "context_first",
    max_local_prefill_tokens: int = 0,
    model: str = MODEL,
    protocol: str = "trtllm",
    signing_key: str = SIGNING_KEY,
    context_options: dict[str, Any] | None = None,
) -> Cluster:
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(
        name=f"pool-{model}",
        model=model,
        schedule_style=schedule_style,
        max_local_prefill_tokens=max_local_prefill_tokens,
        protocol=protocol,
        handoff_signing_key=signing_key,
    )
    WorkerEndpoint.objects.create(pool=pool, role="context", url=context.url, options=context_options or {})
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=generation.url)
    _, key = create_api_key(f"test-key-{time.monotonic_ns()}")
    context.reset()
    generation.reset()
    return Cluster(pool=pool, key=key, model=model, context=context, generation=generation)


@pytest.fixture(params=["context_first", "generation_first"])
def schedule_style(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def cluster(
    transactional_db: Any, gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker, schedule_style: str
) -> Cluster:
    cluster = register_cluster(context_worker, generation_worker, schedule_style=schedule_style)
    wait_registered(gateway, cluster)
    return cluster


def wait_registered(gateway: Gateway, cluster: Cluster) -> None:
    """Wait until the gateway routes with this test's pool (each test recreates it)."""

    from workers.models import WorkerEndpoint

    expected = {
        role: WorkerEndpoint.objects.filter(pool=cluster.pool, role=role).count() for role in ("context", "generation")
    }

    def seen() -> bool:
        pool = httpx.get(gateway.url + "/ready", timeout=5).json()["pools"].get(cluster.pool.name, {})
        return pool.get("id") == cluster.pool.id and all(
            pool[role]["registered"] == count for role, count in expected.items()
        )

    wait_until(seen, message=f"gateway never saw pool {cluster.pool.name} #{cluster.pool.id}")


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, message: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message or "condition not met in time")
        time.sleep(interval)


def consumer_scope(cluster: Cluster) -> dict[str, Any]:
    """The ASGI scope of an authenticated `POST /v1/messages`, for driving a consumer in-process."""
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/messages",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in cluster.headers().items()],
    }


def audit_row(request_id: str, *, terminal: bool = True, timeout: float = 10.0) -> Any:
    """The request's audit row, once it exists (and, by default, has a terminal status)."""
    from messages_api.models import MessageRequest

    def find() -> Any:
        row = MessageRequest.objects.filter(request_id=request_id).first()
        if row is None or (terminal and row.status == "in_progress"):
            return None
        return row

    return wait_until(find, timeout, message=f"no {'terminal ' if terminal else ''}audit row for {request_id}")


def reservations_closed(request_id: str, timeout: float = 10.0) -> list[Any]:
    """The request's reservation rows once all are released."""
    from workers.models import Reservation

    def find() -> Any:
        rows = list(Reservation.objects.filter(request_id=request_id))
        return rows if rows and all(r.released_at is not None for r in rows) else None

    return wait_until(find, timeout, message=f"reservations of {request_id} not all released")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `runs_last` go at the end of the run. The prefill/decode pair of real vLLM
    servers (tests/test_vllm_pd_real.py) starts, decodes and stops two engines on this 2-core
    machine, which leaves every process unscheduled for seconds at a time; a timing-sensitive
    test that ran next failed waiting 10 s for an audit row (CI, 2026-12-03)."""
    items.sort(key=lambda item: item.get_closest_marker("runs_last") is not None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this run's SQLite side files, and the gateways' logs when everything passed."""
    import os

    from tests.gateway import PROJECT_ROOT

    state = PROJECT_ROOT / ".gateway"
    for path in state.glob(f"test-{os.getpid()}.sqlite3*"):
        path.unlink(missing_ok=True)
    if exitstatus == 0:
        for path in state.glob(f"test-daphne-{os.getpid()}-*.log"):
            path.unlink(missing_ok=True)
