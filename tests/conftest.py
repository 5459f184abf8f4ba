"""Shared fixtures: real sim worker processes, real daphne gateways, and a registered pool."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

from tests.support import flush_retry
from tests.support.cluster import SIM_ENV, SIM_OPTIONS, Cluster, register_cluster, sim_worker, wait_registered
from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker, start_simworker

# No per-example deadline for hypothesis: its 200 ms default measures the machine, not the code.
# This 2-core machine stalls every process for seconds while a real vLLM engine starts or decodes
# (an 18.8 s stall failed a pure-function property test in CI, 2026-12-03).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# PostgreSQL may abort the flush between tests as a deadlock's victim: it is tried again.
flush_retry.install()

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

    from disagg_project.writer import get_writer
    from messages_api.usage import get_recorder

    with django_db_blocker.unblock():
        get_writer().flush()
        get_recorder().flush()  # in-process requests' usage, or the exit would write it to a dropped database
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )


# The gateways the `gateways` fixture runs, by their settings. The default gateway (no settings of
# its own) serves most modules and lives for the session; one with settings of its own is stopped
# when the module that started it ends. Kept all session long they added up: each idle gateway
# reloads the registry every REGISTRY_REFRESH_INTERVAL_S (0.1 s here), and by the last modules of a
# CI run under coverage some sixty of them took both cores, so a new gateway's first query outlasted
# its test's 5 s wait (CI, 2026-12-06: 76 tests of the last three e2e modules failed that way).
_RUNNING_GATEWAYS: dict[tuple[tuple[str, str], ...], Gateway] = {}


@pytest.fixture(scope="session")
def gateways(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Callable[..., Gateway]]:
    """`gateways(**env)` → a running gateway with those settings (one per distinct env)."""

    def get(**env: str) -> Gateway:
        key = tuple(sorted(env.items()))
        if key not in _RUNNING_GATEWAYS:
            with django_db_blocker.unblock():
                _RUNNING_GATEWAYS[key] = Gateway(env).start()
        return _RUNNING_GATEWAYS[key]

    yield get
    for gateway in _RUNNING_GATEWAYS.values():
        gateway.stop()
    _RUNNING_GATEWAYS.clear()


@pytest.fixture(scope="module", autouse=True)
def stop_the_modules_own_gateways() -> Iterator[None]:
    """After each module (autouse, so torn down after the module's other fixtures): stop the
    gateways with settings of their own that it started (no later module uses them unless it
    starts them again)."""
    yield
    for key in [key for key in _RUNNING_GATEWAYS if key]:
        _RUNNING_GATEWAYS.pop(key).stop()


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


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `runs_last` go at the end of the run. The prefill/decode pair of real vLLM
    servers (tests/realengine/test_vllm_pd_real.py) starts, decodes and stops two engines on this 2-core
    machine, which leaves every process unscheduled for seconds at a time; a timing-sensitive
    test that ran next failed waiting 10 s for an audit row (CI, 2026-12-03)."""
    items.sort(key=lambda item: item.get_closest_marker("runs_last") is not None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this run's SQLite side files, and the gateways' logs when everything passed."""
    import os

    from tests.support.gateway import PROJECT_ROOT

    state = PROJECT_ROOT / ".gateway"
    for path in state.glob(f"test-{os.getpid()}.sqlite3*"):
        path.unlink(missing_ok=True)
    if exitstatus == 0:
        for path in state.glob(f"test-daphne-{os.getpid()}-*.log"):
            path.unlink(missing_ok=True)
