"""A registered test cluster and the waits every end-to-end test uses: sim workers, a pool, an API
key, and conditions polled until they hold (never fixed sleeps)."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from tests.support.gateway import Gateway
from tests.support.simworkers import SimWorker, start_simworker

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


class Worker(Protocol):
    """What a pool needs of a test's worker: its address, and a fresh record for each test (a
    sim worker, or a scripted one standing in for a misbehaving engine)."""

    @property
    def url(self) -> str: ...

    def reset(self) -> None: ...


@dataclass
class Cluster:
    """A registered pool of one context and one generation worker (sim workers unless a test
    brings its own), and an API key."""

    pool: Any
    key: str
    model: str
    context: SimWorker
    generation: SimWorker

    def headers(self, **extra: str) -> dict[str, str]:
        return {"x-api-key": self.key, "anthropic-version": "2023-06-01", "content-type": "application/json", **extra}


def register_cluster(
    context: Worker,
    generation: Worker,
    *,
    schedule_style: str = "context_first",
    max_local_prefill_tokens: int = 0,
    model: str = MODEL,
    protocol: str = "trtllm",
    signing_key: str = SIGNING_KEY,
    context_options: dict[str, Any] | None = None,
    generation_capacity: int | None = None,
    cache_scope: str = "key",
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
        cache_scope=cache_scope,
    )
    WorkerEndpoint.objects.create(pool=pool, role="context", url=context.url, options=context_options or {})
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=generation.url, capacity=generation_capacity)
    _, key = create_api_key(f"test-key-{time.monotonic_ns()}")
    context.reset()
    generation.reset()
    return Cluster(pool=pool, key=key, model=model, context=context, generation=generation)  # type: ignore[arg-type]


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


def call_command_quietly(*args: Any, **options: Any) -> None:
    """A management command run in-process with its output dropped (the operators' commands print
    what they changed)."""
    from django.core.management import call_command

    call_command(*args, stdout=io.StringIO(), **options)
